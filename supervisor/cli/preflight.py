"""``sglang-supervisor preflight``: the checks the daemon runs before a launch, and those of
the server command (it exists and is executable; its Python has SGLang, of the release tested:
another is a warning), as a table (or JSON); exit 0 when all pass, 1 otherwise."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from supervisor import TESTED_SGLANG
from supervisor.core.config import Config

# The adapters and checks are imported where they run: the CLI's parser imports every command
# module, the daemon's process among them.


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``sglang-supervisor preflight`` besides ``--config`` (the CLI adds that)."""
    p.add_argument("--json", action="store_true", help="print the checks as JSON")


def read_state(state_dir: str) -> dict[str, Any] | None:
    """The state file as ``preflight`` reads it: a corrupt one is left where it is (moving it
    aside is the daemon's business)."""
    from supervisor.adapters.store import StateStore

    state, _warning = StateStore(state_dir).load(move_aside=False)
    return state


def read_version(command: Sequence[str]) -> tuple[str | None, str]:
    """The SGLang version of the server command's Python (a child process, bounded), or why not."""
    from supervisor.adapters import versions

    try:
        return versions.sglang_version(versions.server_python(command), timeout_s=VERSION_TIMEOUT_S), ""
    except versions.VersionError as exc:
        return None, str(exc)


VERSION_TIMEOUT_S = 30.0  # the child only reads package metadata; a cold disk still answers in seconds


def run(args: argparse.Namespace, cfg: Config) -> int:
    """Print the checks; 0 when all pass (a warning passes), 1 otherwise."""
    from supervisor.adapters import cleanup
    from supervisor.cli import registry
    from supervisor.services.preflight import all_ok, cli_checks, format_table

    checks = asyncio.run(cli_checks(cfg, registry.make_probe(cfg.gpu), cleanup=cleanup, read_state=read_state,
                                    read_version=read_version, tested=TESTED_SGLANG))
    if getattr(args, "json", False):
        print(json.dumps({"ok": all_ok(checks), "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(format_table(checks))
    return 0 if all_ok(checks) else 1
