"""MQTT alerts against a real mosquitto broker: delivery, Will, outages, auth, TLS, drill."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import psutil
import pytest
from structlog.testing import capture_logs

from supervisor.adapters.mqtt import MqttTransport
from supervisor.cli.drill import drill, run
from supervisor.core.config import Config, MqttConfig
from supervisor.sinks.alerts import AlertSink, Topics
from tests.conftest import wait_until
from tests.edge import typed
from tests.mosquitto import BlackHole, Broker, Collector, Received, make_tls_files, retained
from tests.test_alerts import CRASH, RECOVERED, RESTART, alerter, until

pytestmark = pytest.mark.integration

HOST, INSTANCE = "gpu-node-3", "kimi"
TOPICS = Topics.of("sglang-supervisor", HOST, INSTANCE)
ALL = "sglang-supervisor/#"


def mqtt_cfg(port: int, **kw: Any) -> MqttConfig:
    """Fast reconnects and generous timeouts: this machine is small and shared."""
    base: dict[str, Any] = {"enabled": True, "host": "127.0.0.1", "port": port, "keepalive_s": 5,
                            "connect_timeout_s": 20, "reconnect_initial_s": 0.05, "reconnect_max_s": 0.5}
    return MqttConfig(**{**base, **kw})


@contextlib.asynccontextmanager
async def running(cfg: MqttConfig, *, close_timeout: float = 20.0,
                  **kw: Any) -> AsyncIterator[tuple[AlertSink, MqttTransport]]:
    """A sink and its started transport, which is always closed."""
    sink, transport = alerter(cfg, host=HOST, instance=INSTANCE, **kw)
    await transport.start()
    try:
        yield sink, transport
    finally:
        await transport.aclose(close_timeout)


def events(sub: Collector) -> list[Received]:
    return [m for m in sub.messages if "/event/" in m.topic]


def last_status(sub: Collector) -> bytes | None:
    statuses = sub.on("/status")
    return statuses[-1].payload if statuses else None


@pytest.fixture
def no_children_left() -> Iterator[None]:
    """Fails the test if it leaves a child process of ours (running or zombie) behind.

    Unlike ``no_leftovers`` it looks only at this process's descendants, so it never
    touches processes of other test runs sharing the machine.
    """
    yield

    def descendants() -> list[psutil.Process]:
        return psutil.Process().children(recursive=True)

    try:
        wait_until(lambda: not descendants(), timeout=15.0, what="our child processes to be gone")
    except AssertionError:
        left = []
        for p in descendants():
            with contextlib.suppress(psutil.Error):
                left.append((p.pid, p.status(), p.cmdline()))
                p.kill()
        pytest.fail(f"leftover child processes: {left}")


@pytest.fixture
def brokers(tmp_path: Path, no_children_left: None) -> Iterator[Callable[..., Broker]]:
    """Makes brokers in tmp_path; every one is stopped (and reaped) afterwards."""
    made: list[Broker] = []

    def make(**kw: Any) -> Broker:
        broker = Broker(tmp_path / f"broker{len(made)}", **kw)
        made.append(broker)
        return broker

    yield make
    for broker in made:
        broker.stop()


@pytest.fixture
def broker(brokers: Callable[..., Broker]) -> Broker:
    b = brokers()
    b.start()
    return b


async def test_events_arrive_as_readable_json_on_their_topics(broker: Broker) -> None:
    """Crash, restart and recovery arrive in order as JSON; status and state are retained."""
    async with Collector(broker, ALL) as sub:
        async with running(mqtt_cfg(broker.port)) as (sink, a):
            await sub.wait_for(lambda: last_status(sub) == b"online", what="status online")
            sink.emit(typed("launch", {"mem_fraction_static": 0.93, "attempt": 1}))
            sink.emit(typed("state_changed", {"from": "READY", "to": "BACKOFF", "reason": "crash",
                                              "mem_fraction_static": 0.93, "restarts": 0,
                                              "last_cause": "cuda_oom_runtime"}))
            sink.emit(typed("crash", CRASH))
            sink.emit(typed("restart_scheduled", RESTART))
            sink.emit(typed("probe", {"ok": True, "duration_s": 1.0}))
            sink.emit(typed("recovered", RECOVERED))
            await sub.wait_for(lambda: len(events(sub)) >= 3 and sub.on("/state"), what="three events and state")
            assert a.sent == 3
        await sub.wait_for(lambda: last_status(sub) == b"offline", what="status offline on clean stop")

    got = events(sub)
    assert [m.topic for m in got] == [TOPICS.event("crash"), TOPICS.event("restart"), TOPICS.event("recovered")]
    assert all(m.qos == 1 for m in got)
    crash = got[0].json()
    assert crash["message"] == "sglang kimi on gpu-node-3 died of a CUDA OOM while serving at 0.93; restarting at 0.88 in 10 s"
    assert (crash["kind"], crash["severity"], crash["cause"]) == ("crash", "warning", "cuda_oom_runtime")
    assert (crash["mem_fraction_static"], crash["next_mem_fraction_static"], crash["next_retry_s"]) == (0.93, 0.88, 10.0)
    assert "CUDA out of memory" in crash["evidence"]
    assert len({m.json()["id"] for m in got}) == 3
    assert sub.on("/state")[-1].json()["state"] == "BACKOFF"

    kept = await retained(broker, ALL)
    assert set(kept) == {TOPICS.status, TOPICS.state}, "only status and state are retained"
    assert kept[TOPICS.status].payload == b"offline" and kept[TOPICS.status].retain
    assert kept[TOPICS.state].json()["state"] == "BACKOFF" and kept[TOPICS.state].retain


CHILD = """
import asyncio, sys
from supervisor.adapters.mqtt import MqttTransport
from supervisor.core.config import MqttConfig
from supervisor.sinks.alerts import Topics, client_id

async def main():
    up = asyncio.Event()
    cfg = MqttConfig(enabled=True, port=int(sys.argv[1]), keepalive_s=5)
    host, instance = sys.argv[2], sys.argv[3]
    a = MqttTransport(cfg, client_id=client_id(cfg, host, instance),
                      status_topic=Topics.of(cfg.topic_prefix, host, instance).status,
                      on_health=lambda k, v: up.set() if (k, v) == ("mqtt_connected", True) else None)
    await a.start()
    await up.wait()
    print("CONNECTED", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_will_marks_the_instance_offline_when_the_daemon_is_sigkilled(broker: Broker) -> None:
    """A SIGKILLed daemon cannot say goodbye: the broker publishes its Will, a retained offline."""
    async with Collector(broker, TOPICS.status) as sub:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, str(broker.port), HOST, INSTANCE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            async with asyncio.timeout(60):
                while (line := await proc.stdout.readline()) != b"CONNECTED\n":  # type: ignore[union-attr]
                    assert line, "the child exited before connecting"
            await sub.wait_for(lambda: last_status(sub) == b"online", what="status online")
        finally:
            proc.kill()
            await proc.wait()
        await sub.wait_for(lambda: last_status(sub) == b"offline", what="the Will's offline")
    kept = await retained(broker, TOPICS.status)
    assert kept[TOPICS.status].payload == b"offline" and kept[TOPICS.status].retain


async def test_alerts_queued_while_the_broker_is_down_arrive_in_order(brokers: Callable[..., Broker]) -> None:
    """Alerts emitted before the broker is up are delivered, in order, once it is."""
    broker = brokers(persistent=True)
    broker.start()
    async with Collector(broker, TOPICS.event("#"), persistent=True) as sub:
        await broker.astop()
        async with running(mqtt_cfg(broker.port)) as (sink, a):
            for attempt in range(1, 6):
                sink.emit(typed("crash", {**CRASH, "attempt": attempt}))
            await until(lambda: a.connect_failures >= 1, what="a failed connect")
            await broker.astart()
            await sub.wait_for(lambda: len(events(sub)) >= 5, what="five crash events")
    assert [m.json()["attempt"] for m in events(sub)] == [1, 2, 3, 4, 5]


async def test_a_flapping_broker_loses_no_alert(brokers: Callable[..., Broker]) -> None:
    """Stopping and starting the broker twice amid alerts loses none of them (counted by id)."""
    broker = brokers(persistent=True)
    broker.start()
    emitted = 0
    async with Collector(broker, TOPICS.event("#"), persistent=True) as sub, \
            running(mqtt_cfg(broker.port)) as (sink, a):
        await until(lambda: a.connected, what="the alerter to connect")

        def burst() -> None:
            nonlocal emitted
            for _ in range(4):
                emitted += 1
                sink.emit(typed("crash", {**CRASH, "attempt": emitted}))

        burst()
        for _ in range(2):
            await broker.astop()
            burst()
            await until(lambda: not a.connected, what="the alerter to notice the outage")
            await broker.astart()
            burst()
        await sub.wait_for(lambda: {m.json()["attempt"] for m in events(sub)} == set(range(1, emitted + 1)),
                           what=f"all {emitted} alerts")
        assert a.dropped == 0
    assert len({m.json()["id"] for m in events(sub)}) == emitted


async def test_a_crash_during_a_broker_outage_is_delivered_and_never_delays_the_restart(
    brokers: Callable[..., Broker],
) -> None:
    """With the broker down across a crash, the restart goes ahead at once and the alert arrives later."""
    broker = brokers(persistent=True)
    broker.start()
    order: list[str] = []
    async with Collector(broker, TOPICS.event("#"), persistent=True) as sub, \
            running(mqtt_cfg(broker.port)) as (sink, a):
        await until(lambda: a.connected, what="the alerter to connect")
        await broker.astop()
        await until(lambda: not a.connected, what="the alerter to notice the outage")
        loop = asyncio.get_running_loop()
        restarted = loop.create_future()
        # The daemon's crash handling: emit the alert, then relaunch on the next loop turn.
        sink.emit(typed("crash", CRASH))
        order.append("crash_emitted")
        loop.call_soon(lambda: (order.append("relaunched"), restarted.set_result(None)))
        await restarted
        failures = a.connect_failures
        await until(lambda: a.connect_failures >= failures + 2, what="two more failed reconnects")
        order.append("broker_back")
        await broker.astart()
        await sub.wait_for(lambda: events(sub), what="the crash alert")
    assert order == ["crash_emitted", "relaunched", "broker_back"]
    assert events(sub)[0].json()["kind"] == "crash"


async def test_a_black_hole_broker_never_delays_emit(no_children_left: None) -> None:
    """While a connect hangs on a broker that never answers, 1,000 emits return before it times out."""
    order: list[str] = []
    with BlackHole() as hole:
        cfg = mqtt_cfg(hole.port, connect_timeout_s=30, outbox_size=100)
        health = lambda kind, value: order.append(kind) if kind != "mqtt_connected" else None  # noqa: E731
        async with running(cfg, close_timeout=1, on_health=health) as (sink, a):
            await until(hole.has_pending_connection, what="the connect to reach the black hole")
            loop = asyncio.get_running_loop()
            relaunched = loop.create_future()
            for attempt in range(1000):
                sink.emit(typed("crash", {**CRASH, "attempt": attempt}))
            order.append("emitted")
            loop.call_soon(lambda: (order.append("relaunched"), relaunched.set_result(None)))
            await relaunched
            assert a.connect_failures == 0 and not a.connected, "the connect is still hanging"
    assert order[:2] == ["alert_dropped"] * 2 and order.count("alert_dropped") == 900
    assert [k for k in order if k != "alert_dropped"][:2] == ["emitted", "relaunched"]
    assert a.dropped == 900 and a.pending == 100


async def test_drill_is_acknowledged_by_a_running_broker(broker: Broker) -> None:
    """The drill publishes a readable drill alert and reports the broker's acknowledgement."""
    async with Collector(broker, TOPICS.event("drill")) as sub:
        result = await drill(mqtt_cfg(broker.port), host=HOST, instance=INSTANCE, timeout_s=20)
        await sub.wait_for(lambda: events(sub), what="the drill alert")
    assert result.acknowledged and result.topic == TOPICS.event("drill")
    payload = events(sub)[0].json()
    assert (payload["kind"], payload["severity"]) == ("drill", "info")
    assert payload["message"] == "Drill from sglang kimi on gpu-node-3: the alert path works; no action needed"


def test_drill_command_exits_0_when_acknowledged(broker: Broker, capsys: pytest.CaptureFixture[str]) -> None:
    """`sglang-supervisor drill` prints one line and exits 0 when the broker acknowledges."""
    code = run(argparse.Namespace(timeout=20.0, host_name=HOST), Config(mqtt=mqtt_cfg(broker.port), name="kimi"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("drill: acknowledged: broker 127.0.0.1:") and out.count("\n") == 1


USER, PASSWORD = "alerter", "s3cr3t-Pa55-wOrd"


async def test_password_file_authenticates_with_the_broker(brokers: Callable[..., Broker], tmp_path: Path) -> None:
    """A broker that requires a login accepts the password read from password_file."""
    broker = brokers(users={USER: PASSWORD})
    broker.start()
    pw = tmp_path / "mqtt.pw"
    pw.write_text(PASSWORD + "\n")
    pw.chmod(0o600)
    cfg = mqtt_cfg(broker.port, username=USER, password_file=str(pw))
    async with Collector(broker, TOPICS.event("#"), username=USER, password=PASSWORD) as sub:
        async with running(cfg) as (sink, a):
            sink.emit(typed("crash", CRASH))
            await sub.wait_for(lambda: events(sub), what="the crash alert")
    assert events(sub)[0].json()["kind"] == "crash"


async def test_a_wrong_password_is_logged_clearly_retried_and_never_leaked(
    brokers: Callable[..., Broker], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused login logs one clear line per try, keeps retrying, and the password shows nowhere."""
    broker = brokers(users={USER: PASSWORD})
    broker.start()
    wrong = "wr0ng-but-still-SECRET"
    pw = tmp_path / "mqtt.pw"
    pw.write_text(wrong + "\n")
    pw.chmod(0o600)
    caplog.set_level(logging.DEBUG)
    cfg = mqtt_cfg(broker.port, username=USER, password_file=str(pw))
    with capture_logs() as logs:
        async with running(cfg) as (_, a):
            await until(lambda: a.connect_failures >= 2, what="two refused logins")
            assert a.running and not a.connected
            shown = repr(a)
            pw.write_text(PASSWORD + "\n")  # the operator fixes the file: the next try logs in
            await until(lambda: a.connected, what="login with the fixed password")
    refused = [e for e in logs if e["event"] == "mqtt_auth_failed"]
    assert len(refused) >= 2 and refused[0]["log_level"] == "error"
    assert "refused the credentials" in refused[0]["detail"] and str(pw) in refused[0]["detail"]
    everything = repr(logs) + caplog.text + shown + repr(a)
    assert wrong not in everything and PASSWORD not in everything


async def test_tls_with_a_ca_made_in_the_test(brokers: Callable[..., Broker], tmp_path: Path) -> None:
    """Alerts flow over TLS verified against the test's CA."""
    tls = make_tls_files(tmp_path / "tls", server_name="localhost")
    broker = brokers(tls=tls)
    broker.start()
    sub_tls = {"tls_params": aiomqtt.TLSParameters(ca_certs=str(tls.ca_cert)), "tls_insecure": True}
    cfg = mqtt_cfg(broker.port, host="localhost", tls=True, tls_ca_file=str(tls.ca_cert))
    async with Collector(broker, TOPICS.event("#"), **sub_tls) as sub:
        async with running(cfg) as (sink, a):
            sink.emit(typed("crash", CRASH))
            await sub.wait_for(lambda: events(sub), what="the crash alert over TLS")
    assert events(sub)[0].json()["kind"] == "crash"


async def test_tls_refuses_a_name_mismatch_unless_explicitly_insecure(
    brokers: Callable[..., Broker], tmp_path: Path,
) -> None:
    """A certificate for another name fails with a TLS reason; tls_insecure = true lets it through."""
    tls = make_tls_files(tmp_path / "tls", server_name="broker.example")
    broker = brokers(tls=tls)
    broker.start()
    reasons: list[str] = []
    strict = mqtt_cfg(broker.port, tls=True, tls_ca_file=str(tls.ca_cert))
    health = lambda kind, value: reasons.append(value) if kind == "mqtt_connect_failed" else None  # noqa: E731
    async with running(strict, on_health=health) as (_, a):
        await until(lambda: a.connect_failures >= 1, what="a refused TLS handshake")
        assert not a.connected
    assert reasons[0] == "tls"
    insecure = mqtt_cfg(broker.port, tls=True, tls_ca_file=str(tls.ca_cert), tls_insecure=True)
    result = await drill(insecure, host=HOST, instance=INSTANCE, timeout_s=20)
    assert result.acknowledged, result.detail
    refused = await drill(strict, host=HOST, instance=INSTANCE, timeout_s=20)
    assert not refused.acknowledged and "TLS" in refused.detail

