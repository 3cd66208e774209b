"""The command line speaks to users (issue 14, item 8): ``--help`` says what the tool does
and every command's ``--help`` shows an example; a bad command is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import REPO

COMMANDS = ("run", "check-config", "status", "restart", "explain", "preflight", "drill", "fleet", "demo")


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
