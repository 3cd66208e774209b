"""The daemon's composition root wires the MQTT alerter's health reports to the metrics sink
through the one mapping, ``Metrics.alerting_health`` (issue 14, item 1).

A copy of that mapping in ``cli.run.run_daemon_async`` once left out ``mqtt_connect_failed``: with
the broker down the daemon logged connect failures while
``sglang_supervisor_mqtt_connect_failures_total`` stayed 0. These tests build the alerter the
way the daemon does (``cli.run.build_alerter``) and feed its health hook.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import structlog
from prometheus_client import CollectorRegistry

from supervisor.cli import run as cli
from supervisor.core.config import Config, MqttConfig
from supervisor.sinks.metrics import Metrics
from tests.conftest import free_port

P = "sglang_supervisor_"


def daemon_alerter(metrics: Metrics | None, mqtt: MqttConfig | None = None) -> cli.MqttTransport:
    """The MQTT transport of the daemon's alerts (the one that reports health)."""
    cfg = replace(Config(), mqtt=mqtt or MqttConfig(enabled=True))
    sink, transport = cli.build_alerter(cfg, host="gpu-node-3", instance="kimi", logger=structlog.get_logger("test"),
                                        metrics=metrics)
    assert sink._outbox is transport  # the sink hands its messages to the transport
    return transport


def test_a_failed_broker_connect_is_counted_by_the_daemons_wiring() -> None:
    """("mqtt_connect_failed", "timeout") from the daemon's alerter counts once, by reason."""
    registry = CollectorRegistry()
    alerter = daemon_alerter(Metrics(registry))
    alerter._health("mqtt_connect_failed", "timeout")
    assert registry.get_sample_value(P + "mqtt_connect_failures_total", {"reason": "timeout"}) == 1
    alerter._health("mqtt_connected", True)
    alerter._health("alert_sent", "crash")
    alerter._health("alert_dropped", "gave_up")
    assert registry.get_sample_value(P + "mqtt_connected") == 1
    assert registry.get_sample_value(P + "alerts_sent_total", {"kind": "crash"}) == 1
    assert registry.get_sample_value(P + "alerts_dropped_total", {"kind": "gave_up"}) == 1


def test_the_health_callback_is_the_metrics_sinks_own_and_a_no_op_without_metrics() -> None:
    """One mapping: the callback is Metrics.alerting_health; metrics off means nothing to call."""
    metrics = Metrics(CollectorRegistry())
    assert cli.alerting_health_callback(metrics) == metrics.alerting_health
    cli.alerting_health_callback(None)("mqtt_connect_failed", "timeout")  # no error, nothing counted
    daemon_alerter(None)._health("mqtt_connect_failed", "timeout")


async def test_a_broker_that_is_down_shows_in_the_connect_failure_counter() -> None:
    """End to end: the daemon's alerter against a port nobody listens on counts its failures."""
    registry = CollectorRegistry()
    mqtt = MqttConfig(enabled=True, host="127.0.0.1", port=free_port(), connect_timeout_s=2.0,
                      reconnect_initial_s=0.05, reconnect_max_s=0.05)
    alerter = daemon_alerter(Metrics(registry), mqtt)
    await alerter.start()
    try:
        for _ in range(200):
            if alerter.connect_failures >= 2:
                break
            await asyncio.sleep(0.02)
    finally:
        await alerter.aclose(timeout_s=2.0)
    counted = sum(registry.get_sample_value(P + "mqtt_connect_failures_total", {"reason": r}) or 0.0
                  for r in ("auth", "config", "tls", "timeout", "error"))
    assert alerter.connect_failures >= 2
    assert counted == alerter.connect_failures


def test_demo_without_the_sim_extra_says_so_in_one_line(monkeypatch, capsys) -> None:
    """Without the [sim] extra (no setproctitle) the demo fails in one line that names the
    extra, instead of a simulator dying at import over and over."""
    import importlib.util

    from supervisor.cli import main, registry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "setproctitle" else real(name, *a))
    assert main(["demo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[sim] extra" in err[0] and registry.SIM_EXTRA_HINT in err[0]
