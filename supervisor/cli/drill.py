"""``sglang-supervisor drill``: publish a drill alert the way a real one goes, and say whether
the broker acknowledged it (exit 0) or not (exit 1)."""

from __future__ import annotations

import argparse
import asyncio
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from supervisor.core.config import Config, MqttConfig, alert_instance

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

# The MQTT client (aiomqtt, paho) and the alerts' words are imported by ``drill`` itself: the
# CLI's parser imports every command module, and the daemon (``run``) loads them only when
# [mqtt] is on.


@dataclass(frozen=True, slots=True)
class DrillResult:
    """Whether the broker acknowledged a drill alert."""

    acknowledged: bool
    detail: str
    topic: str


async def drill(
    cfg: MqttConfig,
    *,
    host: str,
    instance: str,
    timeout_s: float = 10.0,
    logger: FilteringBoundLogger | None = None,
    clock: Callable[[], datetime] | None = None,
) -> DrillResult:
    """Publish one ``drill`` alert (QoS >= 1) and report whether the broker acknowledged it.

    The alerts sink words it (``drill_message``), the MQTT adapter sends it (``publish_once``).
    Each step (connect, TLS, CONNACK, PUBACK) waits at most ``timeout_s``. The drill uses
    its own client id and no Will, so it never disturbs a running daemon's connection.
    """
    import structlog

    from supervisor.adapters.mqtt import PUBLISH_ERRORS, failure, publish_once
    from supervisor.sinks.alerts import client_id, drill_message, utcnow

    log = logger if logger is not None else structlog.get_logger("supervisor.cli.drill")
    alert_id = str(uuid.uuid4())
    ts = (clock or utcnow)()
    topic, payload = drill_message(cfg, host=host, instance=instance, ts=ts, alert_id=alert_id)
    try:
        await publish_once(cfg, f"{client_id(cfg, host, instance)}-drill-{alert_id[:8]}", topic, payload,
                           retain=False, timeout_s=timeout_s, log=log)
    except PUBLISH_ERRORS as exc:
        return DrillResult(False, failure(exc, cfg)[1], topic)
    return DrillResult(True, f"broker {cfg.host}:{cfg.port} acknowledged drill {alert_id}", topic)


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
    from supervisor.sinks.alerts import default_host

    host = getattr(args, "host_name", None) or default_host()
    result = asyncio.run(drill(cfg.mqtt, host=host, instance=alert_instance(cfg), timeout_s=float(timeout)))
    if result.acknowledged:
        print(f"drill: acknowledged: {result.detail} on {result.topic}")
        return 0
    print(f"drill: NOT acknowledged: {result.detail} (topic {result.topic})")
    return 1
