"""``sglang-supervisor demo``: the seed's night against a simulated SGLang on simulated GPUs
(``supervisor/sim/demo.py``), reached through the registry."""

from __future__ import annotations

import argparse

from supervisor.cli import registry
from supervisor.cli.common import fail


def add_arguments(p: argparse.ArgumentParser) -> None:
    registry.add_demo_arguments(p)


def run(args: argparse.Namespace) -> int:
    missing = registry.sim_missing()
    if missing is not None:
        return fail(missing, 1)
    from supervisor.cli.report import demo_report  # the night's report at the end (the daemon never loads it)
    from supervisor.cli.run import run_daemon_async

    return registry.run_demo(args, run_daemon_async, demo_report)
