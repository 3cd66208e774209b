"""The argv we launch must parse with SGLang's own ``launch_server`` parser (issue 2).

SGLang cannot be installed here (it pulls torch and CUDA), so tests/data/
sglang_server_args_flags.txt vendors the option names of ``ServerArgs.add_cli_args`` from
the sglang 0.5.6.post2 wheel. The test builds an argparse parser from it with
``allow_abbrev=False`` (so a flag only passes when spelled in full, as it must be for 0.5.23
where abbreviations broke) and parses the argv of ``run --dry-run``. No network at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.core.argv import build_argv
from supervisor.core.config import MANAGED_FLAGS, build_config, load_config

REPO = Path(__file__).resolve().parent.parent
FLAGS_FILE = REPO / "tests" / "data" / "sglang_server_args_flags.txt"
EXAMPLE = REPO / "etc" / "supervisor.example.toml"
LAUNCH_PREFIX = ("python", "-m", "sglang.launch_server")


def sglang_options() -> dict[str, str]:
    """Every option name in the vendored list -> its kind (value, flag, nargs=X)."""
    options: dict[str, str] = {}
    for line in FLAGS_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        *names, kind = line.split()
        for name in names:
            options[name] = kind
    return options


def sglang_parser() -> argparse.ArgumentParser:
    """An argparse parser with SGLang 0.5.6's option names, abbreviations refused."""
    parser = argparse.ArgumentParser(prog="launch_server", allow_abbrev=False, add_help=False)
    for line in FLAGS_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        *names, kind = line.split()
        if kind == "flag":
            parser.add_argument(*names, action="store_true")
        elif kind.startswith("nargs="):
            parser.add_argument(*names, nargs=kind.removeprefix("nargs="))
        else:
            parser.add_argument(*names)
    return parser


def parse_like_sglang(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` after the launch_server prefix; fail on any leftover or unknown flag."""
    assert tuple(argv[:3])[1:] == LAUNCH_PREFIX[1:], argv[:3]
    args, leftovers = sglang_parser().parse_known_args(argv[3:])
    assert leftovers == [], f"SGLang would reject: {leftovers}"
    return args


def example_copy(tmp_path: Path) -> Path:
    """etc/supervisor.example.toml copied with mode 0644 (a checkout under umask 002 would
    make the original group-writable, which the loader rightly refuses)."""
    copy = tmp_path / EXAMPLE.name
    shutil.copyfile(EXAMPLE, copy)
    copy.chmod(0o644)
    return copy


def test_flag_list_is_complete_enough() -> None:
    """The vendored list holds SGLang's options, aliases included (a sanity check on the file)."""
    options = sglang_options()
    assert len(options) > 250
    assert options["--tp-size"] == options["--tensor-parallel-size"] == "value"
    assert options["--enable-hierarchical-cache"] == "flag"
    assert "--tp" not in options  # only ever worked by prefix matching


def test_every_flag_we_emit_is_an_sglang_flag() -> None:
    """Every option build_argv can emit exists in SGLang's parser, spelled in full."""
    cfg = build_config({"server": {"model_path": "m", "tp_size": 8, "dp_size": 2}})
    argv = build_argv(cfg, 0.88, 48)
    emitted = {a for a in argv if a.startswith("--")}
    assert emitted == {
        "--model-path", "--host", "--port", "--tp-size", "--dp-size", "--mem-fraction-static",
        "--enable-hierarchical-cache", "--hicache-size",
    }
    assert emitted <= set(sglang_options())
    args = parse_like_sglang(list(argv))
    assert (args.tensor_parallel_size, args.data_parallel_size, args.hicache_size) == ("8", "2", "48")
    assert args.enable_hierarchical_cache and args.mem_fraction_static == "0.88"


def test_managed_flags_are_sglang_flags() -> None:
    """The flags config refuses in extra_args are real SGLang options (0.5.23's --enable-hicache
    alias aside), so the refusal guards against real overrides."""
    assert set(MANAGED_FLAGS) - {"--enable-hicache"} <= set(sglang_options())


def test_example_config_argv_parses_with_sglang_parser(tmp_path: Path) -> None:
    """The example's full argv (with its extra_args) parses with nothing left over."""
    cfg = load_config(example_copy(tmp_path), [f"state.dir={tmp_path / 'state'}"])
    argv = list(build_argv(cfg, cfg.server.mem_fraction_static or 0.93, cfg.server.hicache_size_gb))
    argv[:1] = ["python"]  # the example points at /opt/sglang/venv/bin/python
    args = parse_like_sglang(argv)
    assert (args.model_path, args.tensor_parallel_size, args.mem_fraction_static) == (
        "moonshotai/Kimi-K2.5", "8", "0.93",
    )
    assert args.trust_remote_code and args.reasoning_parser == "kimi_k2"
    assert args.enable_hierarchical_cache and args.hicache_size == "48"


def test_dry_run_prints_one_json_array_that_sglang_accepts(tmp_path: Path) -> None:
    """``run --dry-run`` on the example exits 0 and prints exactly one JSON array of strings,
    which SGLang's parser accepts in full."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH")}
    result = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "run", "--dry-run",
         "--config", str(example_copy(tmp_path)), "--set", f"state.dir={tmp_path / 'state'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    argv = json.loads(lines[0])
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    assert argv[0] == "/opt/sglang/venv/bin/python"
    assert "--tp" not in argv and argv[argv.index("--tp-size") + 1] == "8"
    parse_like_sglang(["python", *argv[1:]])


def test_abbreviated_or_unknown_flags_are_caught() -> None:
    """The check has teeth: ``--tp 8`` or a misspelt flag would be reported as leftovers."""
    for bad in (["--tp", "8"], ["--reasoning_parser", "kimi_k2"], ["--cuda-graph-max-bs-decode", "8"]):
        _args, leftovers = sglang_parser().parse_known_args(["--model-path", "m", *bad])
        assert leftovers, bad


@pytest.mark.parametrize("fraction", [0.93, 0.88, 0.85, 0.82, 0.80])
def test_every_rung_parses(fraction: float) -> None:
    """Each rung of the ladder is printed as a value SGLang's float() reads back exactly."""
    cfg = build_config({"server": {"model_path": "m"}})
    args = parse_like_sglang(list(build_argv(cfg, fraction, 0)))
    assert float(args.mem_fraction_static) == fraction
