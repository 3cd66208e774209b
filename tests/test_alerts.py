"""Unit tests of the MQTT alerts: payloads, messages, backoff, and the outbox (no broker).

The alerts sink (``supervisor.sinks.alerts.AlertSink``) words typed events; the MQTT
transport (``supervisor.adapters.mqtt.MqttTransport``) holds the outbox and the connection.
``alerter`` wires the two as the daemon does (``cli.run.build_alerter``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from supervisor.adapters.mqtt import RECONNECT_FACTOR, RECONNECT_JITTER, MqttTransport
from supervisor.cli.drill import drill, run
from supervisor.core.backoff import exponential_backoff
from supervisor.core.config import Config, MqttConfig
from supervisor.core.events import ALERT_KINDS, StateChanged
from supervisor.sinks.alerts import (
    SEVERITY,
    AlertSink,
    Drill,
    Topics,
    build_alert,
    build_state,
    client_id,
    truncate_evidence,
    utcnow,
)
from tests.conftest import free_port
from tests.edge import typed

TS = datetime(2026, 10, 4, 3, 12, 9, 123456, tzinfo=UTC)
HOST, INSTANCE = "gpu-node-3", "kimi"

CRASH: dict[str, Any] = {
    "cause": "cuda_oom_runtime", "remedy": "fraction_down", "phase": "serving", "exit_code": None,
    "signal": 9, "evidence": ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."],
    "evidence_lineno": 812, "location": "deepseek_v2.py:2919 forward", "rank": "TP3",
    "exc_type": "torch.OutOfMemoryError", "exc_message": "CUDA out of memory", "mem_fraction_static": 0.93,
    "hicache_size_gb": 0, "attempt": 1, "next_mem_fraction_static": 0.88, "next_hicache_size_gb": 0,
    "next_retry_s": 10.0, "consecutive_failures": 1,
}
RESTART = {"delay_s": 10.0, "cause": "cuda_oom_runtime", "mem_fraction_static": 0.88, "hicache_size_gb": 0,
           "attempt": 2, "rung": 1, "mem_fraction_before": 0.93}
RECOVERED = {"startup_s": 312.4, "mem_fraction_static": 0.88, "hicache_size_gb": 0, "attempt": 2,
             "cause": "cuda_oom_runtime", "mem_fraction_before": 0.93}


def alert(event: str, fields: dict[str, Any], max_chars: int = 2000) -> dict[str, Any]:
    """The payload of the typed event ``event`` with ``fields`` (the rest at neutral values;
    ``drill``: the drill's)."""
    payload = build_alert(Drill() if event == "drill" else typed(event, fields),  # type: ignore[arg-type]
                          host=HOST, instance=INSTANCE, ts=TS, alert_id="id-1", evidence_max_chars=max_chars)
    assert payload is not None
    return dict(payload)


def alerter(cfg: MqttConfig | None = None, *, host: str = HOST, instance: str = INSTANCE,
            clock: Callable[[], datetime] = utcnow, logger: Any = None, **kw: Any) -> tuple[AlertSink, MqttTransport]:
    """The sink and its transport, wired as the daemon wires them (``cli.run.build_alerter``)."""
    cfg = cfg or MqttConfig(enabled=True)
    transport = MqttTransport(cfg, client_id=client_id(cfg, host, instance),
                              status_topic=Topics.of(cfg.topic_prefix, host, instance).status, logger=logger, **kw)
    return AlertSink(cfg, host=host, instance=instance, outbox=transport, clock=clock, logger=logger), transport


def odd(kind: str, **fields: Any) -> Any:
    """A typed event of ``kind`` whose ``fields`` hold values its types do not allow (nothing
    checks a dataclass's types at run time): what a sink must survive."""
    return dataclasses.replace(typed(kind), **fields)  # type: ignore[type-var]


def test_crash_message_reads_like_the_issue_example() -> None:
    """A runtime CUDA OOM says where it died, at which fraction, and what happens next."""
    assert alert("crash", CRASH)["message"] == (
        "sglang kimi on gpu-node-3 died of a CUDA OOM while serving at 0.93; restarting at 0.88 in 10 s"
    )


def test_crash_payload_carries_every_schema_field() -> None:
    """The crash payload has the issue's fields with the values taken from the event."""
    p = alert("crash", CRASH)
    assert p["ts"] == "2026-10-04T03:12:09.123Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", p["ts"])
    assert {k: p[k] for k in ("host", "instance", "id", "kind", "severity", "cause")} == {
        "host": HOST, "instance": INSTANCE, "id": "id-1", "kind": "crash", "severity": "warning",
        "cause": "cuda_oom_runtime",
    }
    assert (p["mem_fraction_static"], p["next_mem_fraction_static"]) == (0.93, 0.88)
    assert (p["attempt"], p["next_retry_s"]) == (1, 10.0)
    assert p["evidence"] == CRASH["evidence"][0]
    assert json.loads(json.dumps(p)) == p


@pytest.mark.parametrize(("event", "severity"), [
    ("crash", "warning"), ("restart_scheduled", "info"), ("recovered", "info"), ("gave_up", "critical"),
    ("headroom_low", "warning"), ("gpu_memory_stuck", "critical"), ("drill", "info"),
])
def test_each_alert_kind_has_its_severity(event: str, severity: str) -> None:
    """Giving up and stuck GPU memory page as critical; a crash that restarts is a warning."""
    p = alert(event, {})
    assert p["severity"] == severity
    assert p["kind"] == ALERT_KINDS.get(event, "drill")


def test_every_alert_kind_has_a_severity() -> None:
    """No alert kind of the event vocabulary lacks a severity."""
    assert set(ALERT_KINDS.values()) | {"drill"} == set(SEVERITY)


def test_non_alert_events_build_no_alert() -> None:
    """Probes, samples and launches are for logs and metrics, not for phones."""
    for event in ("probe", "gpu_sample", "launch", "state_changed", "server_ready"):
        assert build_alert(typed(event), host=HOST, instance=INSTANCE, ts=TS, alert_id="x",  # type: ignore[arg-type]
                           evidence_max_chars=100) is None


def test_evidence_is_truncated_to_the_limit_with_a_marker() -> None:
    """Long evidence is cut to the configured size and says how much was cut."""
    lines = [f"line {i} " + "x" * 50 for i in range(100)]
    text = truncate_evidence(lines, 200)
    assert len(text) <= 200
    assert re.search(r"\[truncated (\d+) chars\]$", text)
    cut = int(re.search(r"\[truncated (\d+) chars\]$", text).group(1))  # type: ignore[union-attr]
    assert text.startswith("line 0 ")
    assert len("\n".join(lines)) - cut == text.index("\n... [truncated")
    assert truncate_evidence(["short"], 200) == "short"
    assert truncate_evidence(None, 200) == ""
    assert truncate_evidence("one string", 200) == "one string"


def test_restart_and_recovery_report_the_fraction_before_and_after() -> None:
    """A restart and a recovery name the fraction that crashed and the one that replaces it,
    as their events carry them."""
    restart = alert("restart_scheduled", RESTART)
    assert (restart["mem_fraction_static"], restart["next_mem_fraction_static"]) == (0.93, 0.88)
    assert restart["next_retry_s"] == 10.0
    assert restart["message"] == (
        "sglang kimi on gpu-node-3 restarting at 0.88 in 10 s (attempt 2) after a CUDA OOM while serving"
    )
    recovered = alert("recovered", RECOVERED)
    assert (recovered["mem_fraction_static"], recovered["next_mem_fraction_static"]) == (0.93, 0.88)
    assert recovered["message"] == (
        "sglang kimi on gpu-node-3 is serving again at 0.88 after a CUDA OOM while serving "
        "(attempt 2, startup took 312.4 s)"
    )


def test_gave_up_counts_the_crashes_and_asks_for_a_human() -> None:
    """Giving up says how many crashes it took, why, and that a person is needed."""
    p = alert("gave_up", {"reason": "5 crashes within 3600 s", "cause": "cuda_oom_runtime",
                          "mem_fraction_static": 0.8, "crashes": 5})
    assert p["message"] == "sglang kimi on gpu-node-3 gave up after 5 crashes: 5 crashes within 3600 s; needs a human"
    assert (p["mem_fraction_static"], p["next_mem_fraction_static"]) == (0.8, None)
    first = alert("gave_up", {"cause": "gpu_hw_error"})
    assert first["message"] == "sglang kimi on gpu-node-3 gave up: a GPU hardware/driver failure; needs a human"


def test_a_crash_that_will_not_be_restarted_says_so() -> None:
    """With no retry planned the crash alert does not promise a restart."""
    p = alert("crash", {**CRASH, "cause": "gpu_hw_error", "next_retry_s": None, "next_mem_fraction_static": None})
    assert p["message"] == ("sglang kimi on gpu-node-3 died of a GPU hardware/driver failure while serving at 0.93; "
                            "not restarting; needs a human")


def test_host_oom_crash_names_the_smaller_host_cache() -> None:
    """A host OOM restart names the new --hicache-size, and a startup phase is said as such."""
    p = alert("crash", {**CRASH, "cause": "host_oom", "phase": "starting", "hicache_size_gb": 64,
                        "next_hicache_size_gb": 32, "next_mem_fraction_static": 0.93, "next_retry_s": 20})
    assert p["message"] == ("sglang kimi on gpu-node-3 died of host memory exhaustion while starting at 0.93; "
                            "restarting at 0.93 with --hicache-size 32 in 20 s")


def test_headroom_low_says_what_it_does_about_it() -> None:
    """Low headroom names the rank and numbers, and either the step down or the advice."""
    fields = {"avail_mem_gb": 0.82, "threshold_gb": 2.0, "rank": "TP0", "action": "step_down",
              "mem_fraction_static": 0.93, "next_mem_fraction_static": 0.88}
    assert alert("headroom_low", fields)["message"] == (
        "sglang kimi on gpu-node-3 has only 0.8 GB of GPU headroom on TP0 at 0.93 (wants 2.0 GB); "
        "restarting at 0.88 before it OOMs"
    )
    warn = alert("headroom_low", {**fields, "action": "warn", "next_mem_fraction_static": None})
    assert warn["message"].endswith("lower --mem-fraction-static before the next burst OOMs it")


def test_gpu_memory_stuck_lists_the_gpus() -> None:
    """Stuck GPU memory names each GPU's free memory and the way out."""
    gpus = [{"index": 0, "uuid": "GPU-a", "free_bytes": 2e9, "total_bytes": 141e9}]
    p = alert("gpu_memory_stuck", {"gpus": gpus, "timeout_s": 120})
    assert p["message"] == ("GPU memory on gpu-node-3 was still in use 120 s after sglang kimi stopped "
                            "(GPU 0: 2.0 GB of 141.0 GB free); kill what holds it or reset the GPU")
    assert "GPU-a" in p["evidence"]


def test_an_unknown_cause_is_named_rather_than_failing() -> None:
    """A cause name this version does not know (no Cause holds it, but a crash may carry it:
    nothing checks at run time) still yields a readable sentence."""
    crash = dataclasses.replace(typed("crash", CRASH), cause="martian_rays")  # type: ignore[type-var]
    p = build_alert(crash, host=HOST, instance=INSTANCE, ts=TS, alert_id="id-1", evidence_max_chars=2000)
    assert p is not None
    assert "died of an error (martian_rays) while serving" in p["message"]


def test_the_default_fraction_is_named_when_none_was_set() -> None:
    """A server launched without --mem-fraction-static reads as SGLang's default."""
    p = alert("crash", {**CRASH, "mem_fraction_static": None})
    assert "at SGLang's default fraction; restarting at 0.88" in p["message"]


def test_state_snapshot_has_state_and_fraction() -> None:
    """The retained state snapshot carries the new state and the current fraction."""
    changed = typed("state_changed", {"from": "READY", "to": "BACKOFF", "reason": "crash", "mem_fraction_static": 0.93,
                                      "restarts": 1, "last_cause": "cuda_oom_runtime"})
    assert isinstance(changed, StateChanged)
    s = build_state(changed, host=HOST, instance=INSTANCE, ts=TS)
    assert (s["state"], s["from"], s["mem_fraction_static"], s["last_cause"]) == ("BACKOFF", "READY", 0.93,
                                                                                  "cuda_oom_runtime")


def test_topics_keep_host_and_instance_to_one_level() -> None:
    """Slashes and wildcards in a host or instance name cannot change the topic tree."""
    t = Topics.of("sglang-supervisor", "node/3", "kimi#+ x")
    assert t.status == "sglang-supervisor/node_3/kimi___x/status"
    assert t.event("crash") == "sglang-supervisor/node_3/kimi___x/event/crash"


def test_backoff_doubles_clamps_and_jitters_within_half() -> None:
    """Reconnect delays (the policy's one backoff function with the alerter's factor and jitter
    window) grow from initial to max and jitter stays in [d/2, d]."""
    rng = random.Random(7)
    for attempt, nominal in [(0, 1.0), (1, 2.0), (3, 8.0), (6, 60.0), (10_000, 60.0)]:
        for _ in range(50):
            d = exponential_backoff(attempt, initial=1.0, factor=RECONNECT_FACTOR, maximum=60.0,
                                    jitter=RECONNECT_JITTER, sample=rng.random())
            assert nominal / 2 <= d <= nominal


def test_emit_queues_alerts_and_ignores_other_events() -> None:
    """Only alert events enter the outbox, each on its event topic."""
    sink, a = alerter()
    sink.emit(typed("probe", {"ok": True}))
    sink.emit(typed("gpu_sample", {"gpus": []}))
    assert a.pending == 0
    sink.emit(typed("crash", CRASH))
    sink.emit(Drill())
    assert a.pending == 2
    assert [m.topic for m in a._outbox] == [sink.topics.event("crash"), sink.topics.event("drill")]


def test_state_changes_coalesce_to_the_latest_snapshot() -> None:
    """Many state changes while disconnected leave one snapshot to send: the newest."""
    sink, a = alerter()
    for to in ("STARTING", "READY", "BACKOFF"):
        sink.emit(typed("state_changed", {"from": "STOPPED", "to": to}))
    assert a.pending == 1
    assert json.loads(a._state_msg.payload)["state"] == "BACKOFF"  # type: ignore[union-attr]


def test_full_outbox_drops_the_oldest_counts_and_logs() -> None:
    """With the outbox full, each new alert pushes out the oldest, which is counted and logged."""
    health: list[tuple[str, Any]] = []
    with capture_logs() as logs:
        sink, a = alerter(MqttConfig(enabled=True, outbox_size=3), on_health=lambda k, v: health.append((k, v)))
        for i in range(5):
            sink.emit(typed("crash", {**CRASH, "attempt": i}))
    assert a.dropped == 2 and a.pending == 3
    assert health == [("alert_dropped", "crash")] * 2
    dropped_logs = [e for e in logs if e["event"] == "alert_dropped"]
    assert [e["dropped_total"] for e in dropped_logs] == [1, 2]
    assert [json.loads(m.payload)["attempt"] for m in a._outbox] == [2, 3, 4]


def test_emit_never_raises() -> None:
    """Odd fields, a failing clock and a failing health callback never escape emit."""
    def broken_clock() -> datetime:
        raise RuntimeError("clock broke")

    def broken_health(kind: str, value: Any) -> None:
        raise RuntimeError("metrics broke")

    with capture_logs() as logs:
        sink, a = alerter(MqttConfig(enabled=True, outbox_size=1), on_health=broken_health)
        sink.emit(odd("crash", cause=object(), evidence=42, next_retry_s="soon"))
        sink.emit(odd("gpu_memory_stuck", gpus=[None, {"index": "x"}], timeout_s=None))
        sink.emit(odd("headroom_low", avail_mem_gb="lots"))
        sink_b, b = alerter(clock=broken_clock)
        sink_b.emit(typed("crash", CRASH))
    assert a.pending == 1 and a.dropped == 2
    assert b.pending == 0
    events = [e["event"] for e in logs]
    assert "alert_emit_failed" in events and "alert_health_callback_failed" in events


def test_alert_ids_are_unique_uuids() -> None:
    """Every alert gets its own uuid4 so consumers can drop duplicates."""
    sink, a = alerter()
    for _ in range(20):
        sink.emit(typed("crash", CRASH))
    ids = [json.loads(m.payload)["id"] for m in a._outbox]
    assert len(set(ids)) == 20
    assert all(uuid.UUID(i).version == 4 for i in ids)


async def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` on the event loop until it holds, failing after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def closed_port_cfg(**kw: Any) -> MqttConfig:
    return MqttConfig(enabled=True, port=free_port(), reconnect_initial_s=0.02, reconnect_max_s=0.1,
                      connect_timeout_s=10, **kw)


async def test_without_a_broker_it_keeps_retrying_and_keeps_alerts(tmp_path: Path) -> None:
    """A refused connection is logged and retried; queued alerts stay queued; close is prompt."""
    health: list[tuple[str, Any]] = []
    with capture_logs() as logs:
        sink, a = alerter(closed_port_cfg(), on_health=lambda k, v: health.append((k, v)))
        sink.emit(typed("crash", CRASH))
        await a.start()
        await until(lambda: a.connect_failures >= 3, what="three failed connects")
        assert a.running and a.pending == 1
        await a.aclose(5)
    assert not a.running
    assert ("mqtt_connect_failed", "error") in health
    assert any(e["event"] == "mqtt_connect_failed" and "Connection refused" in e["detail"] for e in logs)
    assert any(e["event"] == "alerts_undelivered" and e["pending"] == 1 for e in logs)


async def test_a_world_readable_password_file_warns_once(tmp_path: Path) -> None:
    """A password file others can read draws one warning, however often it is re-read."""
    pw = tmp_path / "mqtt.password"
    pw.write_text("hunter2-not-logged\n")
    pw.chmod(0o644)
    with capture_logs() as logs:
        _, a = alerter(closed_port_cfg(username="u", password_file=str(pw)))
        await a.start()
        await until(lambda: a.connect_failures >= 3, what="three failed connects")
        await a.aclose(5)
    assert [e["event"] for e in logs].count("mqtt_password_file_readable_by_others") == 1
    assert "hunter2-not-logged" not in repr(logs) + repr(a)


async def test_an_unreadable_password_file_is_a_clear_retried_error(tmp_path: Path) -> None:
    """A missing password file is named in an error line and retried, not a crash."""
    missing = tmp_path / "nope"
    with capture_logs() as logs:
        _, a = alerter(closed_port_cfg(username="u", password_file=str(missing)))
        await a.start()
        await until(lambda: a.connect_failures >= 2, what="two failed connects")
        assert a.running
        await a.aclose(5)
    lines = [e for e in logs if e["event"] == "mqtt_connect_failed"]
    assert lines and lines[0]["log_level"] == "error"
    assert f"cannot read [mqtt] password_file {missing}" in lines[0]["detail"]


async def test_drill_is_not_acknowledged_without_a_broker() -> None:
    """The drill reports failure, with the reason, when nothing listens."""
    result = await drill(closed_port_cfg(), host=HOST, instance=INSTANCE, timeout_s=10)
    assert not result.acknowledged
    assert "Connection refused" in result.detail
    assert result.topic == "sglang-supervisor/gpu-node-3/kimi/event/drill"


def test_drill_command_exits_1_without_a_broker_or_when_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    """`sglang-supervisor drill` prints one line and exits 1 when no broker acknowledges."""
    args = argparse.Namespace(timeout=10.0, host_name=HOST)
    assert run(args, Config(mqtt=closed_port_cfg(), name="kimi")) == 1
    assert capsys.readouterr().out.startswith("drill: NOT acknowledged: broker 127.0.0.1:")
    assert run(args, Config(mqtt=MqttConfig(enabled=False), name="kimi")) == 1
    assert "enabled = false" in capsys.readouterr().out


def test_the_restart_alert_of_a_real_event_order_names_the_fraction_that_crashed() -> None:
    """Driven by the state machine itself: its BACKOFF state change (at the new fraction)
    comes before the restart it schedules, so a sink that reconstructed "the fraction before"
    from the events it had seen said 0.88 -> 0.88. The events carry it now."""
    from test_machine import Night, oom_runtime

    from supervisor.core.messages import Diagnosed, Emit, Launched, Prepared, ProbeResult, TimerFired
    from supervisor.core.model import ExitStatus
    from supervisor.core.state import Timer

    night = Night()
    actions = [*night.starting(), *night.send(ProbeResult(ok=True), after=60)]
    actions += night.send(Diagnosed(ExitStatus(signal=9), oom_runtime()))
    actions += [*night.send(TimerFired(Timer.BACKOFF), after=100), *night.send(Prepared()), *night.send(Launched(4242)),
                *night.send(ProbeResult(ok=True), after=30)]
    alerts = {a["kind"]: a for a in (build_alert(e.event, host=HOST, instance=INSTANCE, ts=TS,
                                                 alert_id="x", evidence_max_chars=200)
                                     for e in actions if isinstance(e, Emit)) if a is not None}
    for kind in ("crash", "restart", "recovered"):
        assert (alerts[kind]["mem_fraction_static"], alerts[kind]["next_mem_fraction_static"]) == (0.93, 0.88), kind


async def test_a_broker_outage_is_one_line_and_one_link_down_however_often_it_is_retried() -> None:
    """Every refused connect is counted (connect_failures, mqtt_connect_failed to the health
    hook), but only the first of the outage is a warning; the others are debug lines. The
    link metric's hook hears of the outage once."""
    health: list[tuple[str, Any]] = []
    with capture_logs() as logs:
        _, a = alerter(closed_port_cfg(), on_health=lambda k, v: health.append((k, v)))
        await a.start()
        await until(lambda: a.connect_failures >= 4, what="four failed connects")
        await a.aclose(5)
    loud = [e for e in logs if e["event"] == "mqtt_connect_failed" and e["log_level"] != "debug"]
    assert len(loud) == 1 and loud[0]["log_level"] == "warning" and "Connection refused" in loud[0]["detail"]
    links = [v for k, v in health if k == "link"]
    assert [(type(v).__name__, v.link) for v in links] == [("LinkDown", "mqtt")]
    assert "Connection refused" in links[0].error
    assert [k for k, _ in health].count("mqtt_connect_failed") == a.connect_failures
