"""``sglang-supervisor drill``: publish a drill alert the way a real one goes, and say whether
the broker acknowledged it (exit 0) or not (exit 1)."""

from __future__ import annotations

import argparse
import asyncio
import math

from supervisor.core.config import Config, alert_instance
from supervisor.sinks.alerts import default_host, drill


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``sglang-supervisor drill`` (besides the global ``--config``)."""
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for each step (connect, acknowledgement); default 10")
    p.add_argument("--host-name", default=None, metavar="NAME",
                   help="host name used in the topic and message (default: this machine's)")


def run(args: argparse.Namespace, cfg: Config) -> int:
    """``sglang-supervisor drill``: print one line; exit 0 if the broker acknowledged, else 1."""
    if not cfg.mqtt.enabled:
        print("drill: not sent: [mqtt] enabled = false in the config, so no alert would reach on-call")
        return 1
    timeout = getattr(args, "timeout", 10.0)
    if not (isinstance(timeout, float | int) and timeout > 0 and math.isfinite(timeout)):
        print(f"drill: not sent: --timeout must be a positive number of seconds, got {timeout!r}")
        return 1
    host = getattr(args, "host_name", None) or default_host()
    result = asyncio.run(drill(cfg.mqtt, host=host, instance=alert_instance(cfg), timeout_s=float(timeout)))
    if result.acknowledged:
        print(f"drill: acknowledged: {result.detail} on {result.topic}")
        return 0
    print(f"drill: NOT acknowledged: {result.detail} (topic {result.topic})")
    return 1
