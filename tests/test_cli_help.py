"""The command line speaks to users (issue 14, item 8): ``--help`` says what the tool does
and every command's ``--help`` shows an example; a bad command is one line and exit 2."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO


def _commands() -> tuple[str, ...]:
    """Every command the parser has: one added later is held to the same rules."""
    import argparse

    from supervisor.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return tuple(sub.choices)


COMMANDS = _commands()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


def test_top_level_help_says_what_the_tool_does_and_shows_examples() -> None:
    """``sglang-supervisor --help``: what it is for and example commands, not a module docstring."""
    result = cli("--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Keep an SGLang server running" in out and "--mem-fraction-static" in out
    assert "Example" in out and "sglang-supervisor run --config " in out
    assert "composition root" not in out
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_shows_an_example(command: str) -> None:
    """``sglang-supervisor COMMAND --help`` exits 0 and ends with an example of that command."""
    result = cli(command, "--help")
    assert result.returncode == 0, result.stderr
    example = result.stdout.split("Example:\n", 1)[1]
    assert f"sglang-supervisor {command}" in example


def test_an_unknown_command_is_one_line_and_exit_2() -> None:
    """A typo in the command is refused on one line, without a traceback."""
    result = cli("stauts")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "invalid choice: 'stauts'" in result.stderr


@pytest.mark.parametrize("action", ["list", "reset"])
def test_fleet_actions_help_shows_an_example(action: str) -> None:
    """``sglang-supervisor fleet list|reset --help`` ends with an example of that action."""
    result = cli("fleet", action, "--help")
    assert result.returncode == 0, result.stderr
    assert f"sglang-supervisor fleet {action} --config" in result.stdout.split("Example:\n", 1)[1]


def _config_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every (sub)command of ``parser`` that takes a required ``--config``."""
    found: list[tuple[str, ...]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _config_commands(sub, (*prefix, name))
        elif "--config" in action.option_strings and action.required:
            found.append(prefix)
    return found


def test_every_command_that_reads_a_config_takes_set() -> None:
    """``--set SECTION.KEY=VALUE`` on every command that reads a config (restart and fleet once
    lacked it), and each of them hands it to the config it loads."""
    from supervisor.cli import build_parser

    parser = build_parser()
    commands = _config_commands(parser)
    assert {c[0] for c in commands} >= {"run", "check-config", "status", "restart", "preflight", "drill", "fleet",
                                        "report"}
    for command in commands:
        extra = ["--all"] if command == ("fleet", "reset") else []
        args = parser.parse_args([*command, "--config", "c.toml", "--set", "state.dir=/x", "--set", "server.port=1",
                                  *extra])
        assert args.overrides == ["state.dir=/x", "server.port=1"], command


def test_restart_reads_the_state_dir_given_by_set(tmp_path: Path) -> None:
    """``restart --set state.dir=D`` looks for the daemon's control socket in D (no daemon there:
    one line naming it, not the config file's state directory)."""
    config = tmp_path / "c.toml"
    config.write_text('[server]\nmodel_path = "m"\n[state]\ndir = "/nonexistent/elsewhere"\n')
    config.chmod(0o644)
    result = cli("restart", "--config", str(config), "--set", f"state.dir={tmp_path / 'state'}", "--no-wait")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert str(tmp_path / "state") in result.stderr and "/nonexistent/elsewhere" not in result.stderr
    assert result.stderr.count("\n") == 1
