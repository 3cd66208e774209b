"""[report] daily_at: the daily summary alert, on an injected clock (DST included) and over a
real mosquitto broker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from supervisor.core import events as ev
from supervisor.core.config import config_from_overrides
from supervisor.core.model import Cause, Phase, Remedy, State
from supervisor.services import daily
from supervisor.sinks.alerts import build_alert
from supervisor.sinks.gpuring import GpuRingSink, read_ring
from supervisor.sinks.journal import JournalSink, read_journal

PARIS = ZoneInfo("Europe/Paris")
READERS = daily.Readers(journal=read_journal, ring=read_ring)  # what the composition root hands in
START = datetime(2026, 3, 28, 22, 0, tzinfo=PARIS).timestamp()  # the night before the spring change


def write_night(state: Path, start: float) -> None:
    """0.93, READY, a CUDA OOM 2 h in, 0.88, READY: through the real sinks, at fixed times."""
    t = [start]
    journal = JournalSink(state, clock=lambda: t[0])
    ring = GpuRingSink(state, sample_s=60, keep_days=2, clock=lambda: t[0])

    def at(dt: float, event: ev.Event) -> None:
        t[0] = start + dt
        journal.emit(event)
        ring.emit(ev.GpuSample(gpus=({"index": 0, "total_bytes": 96 << 30,
                                      "free_bytes": (5 << 30) if dt > 7300 else (800 << 20)},)))

    def changed(dt: float, frm: State, to: State) -> None:
        at(dt, ev.StateChanged(from_=frm, to=to, reason="r", mem_fraction_static=None, hicache_size_gb=None,
                               restarts=0, last_cause=None))

    launch = dict(argv=("python",), hicache_size_gb=None, rung=0, launch_id="x")
    changed(0, State.STOPPED, State.STARTING)
    at(1, ev.ServerLaunched(mem_fraction_static=0.93, attempt=1, pid=1, **launch))  # type: ignore[arg-type]
    changed(120, State.STARTING, State.READY)
    at(7200, ev.Crash(cause=Cause.CUDA_OOM_RUNTIME, remedy=Remedy.FRACTION_DOWN, phase=Phase.SERVING, exit_code=None,
                      signal=9, evidence=(), evidence_lineno=None, location=None, rank=None, exc_type=None,
                      exc_message=None, mem_fraction_static=0.93, hicache_size_gb=None, attempt=1,
                      next_mem_fraction_static=0.88, next_hicache_size_gb=None, next_retry_s=2.0,
                      consecutive_failures=1))
    changed(7200, State.READY, State.BACKOFF)
    at(7202, ev.ServerLaunched(mem_fraction_static=0.88, attempt=2, pid=2, **launch))  # type: ignore[arg-type]
    changed(7320, State.STARTING, State.READY)
    journal.close()
    ring.close()


def cfg_for(state: Path, **report: str):
    return config_from_overrides(["server.model_path=m", f"state.dir={state}",
                                  *(f'report.{k}="{v}"' for k, v in report.items())])


def test_the_summary_has_the_key_figures(tmp_path):
    write_night(tmp_path, START)
    now = START + 10 * 3600
    s = daily.summary(cfg_for(tmp_path), now, READERS)
    assert (s.crashes, s.causes, s.state) == (1, ("cuda_oom_runtime x 1",), "READY")
    assert (s.mem_fraction_static, s.next_mem_fraction_static) == (0.93, 0.88)
    assert s.lost_s == 120.0 and s.open_problems == () and s.least_free_gb == pytest.approx(0.78, abs=0.01)
    assert s.serving_pct == pytest.approx(100 * (36000 - 120 - 120) / 36000, abs=0.1)
    payload = build_alert(s, host="gpu-node-3", instance="kimi",
                          ts=datetime.now(PARIS), alert_id="1", evidence_max_chars=2000)
    assert payload is not None and payload["kind"] == "daily_summary" and payload["severity"] == "info"
    assert payload["message"] == (
        "sglang kimi on gpu-node-3, the last 10 h: serving 99.3 % of the time; 1 crash (cuda_oom_runtime x 1), "
        "2.0 min lost; mem_fraction_static 0.93 -> 0.88; now READY; least free GPU memory 0.8 GB; nothing to do")


class FakeClock:
    """Wall time that moves only when the task sleeps."""

    def __init__(self, t: float) -> None:
        self.t = t
        self.slept: list[float] = []
        self.frozen = False  # set: the next sleep never returns (time stops until the task is cancelled)

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        assert 0 < seconds <= daily.STEP_S
        if self.frozen:
            await asyncio.Event().wait()
        self.slept.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


async def test_summaries_come_at_0830_local_time_across_the_spring_change(tmp_path):
    """From 22:00 on 28 March (CET): 08:30 CEST on the 29th (a 23-hour day in Paris), then 08:30
    on the 30th; each a summary of the 24 h before it, through the emit hook."""
    write_night(tmp_path, START)
    clock = FakeClock(START)
    got: list[tuple[str, float, ev.DailySummary]] = []
    cfg = cfg_for(tmp_path, daily_at="08:30", timezone="Europe/Paris")

    def emit(name: str, e: ev.DailySummary) -> None:
        got.append((name, clock.t, e))
        clock.frozen = len(got) >= 2  # no third day before the test looks

    task = asyncio.create_task(daily.run(lambda: cfg, emit, clock=clock, readers=READERS, sleep=clock.sleep))
    while len(got) < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    when = [datetime.fromtimestamp(t, PARIS) for _, t, _ in got]
    assert [w.strftime("%Y-%m-%d %H:%M %Z") for w in when] == ["2026-03-29 08:30 CEST", "2026-03-30 08:30 CEST"]
    assert when[0].timestamp() - START == 9.5 * 3600  # 22:00 CET -> 08:30 CEST is 9.5 h, not 10.5
    assert got[0][0] == "demo" and got[0][2].crashes == 1
    assert got[1][2].crashes == 0 and got[1][2].state == "READY"  # the OOM was more than 24 h before


async def test_a_clock_set_forward_does_not_delay_the_summary(tmp_path):
    """The wait re-reads the wall clock at least every minute: jumping over 08:30 sends it at once."""
    clock = FakeClock(datetime(2026, 6, 1, 7, 0, tzinfo=PARIS).timestamp())
    got: list[float] = []
    cfg = cfg_for(tmp_path, daily_at="08:30", timezone="Europe/Paris")
    task = asyncio.create_task(daily.run(lambda: cfg, lambda name, e: got.append(clock.t), clock=clock, readers=READERS, sleep=clock.sleep))
    await asyncio.sleep(0.05)
    clock.t += 2 * 3600  # 09:00+: past 08:30
    while not got:
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert got[0] - datetime(2026, 6, 1, 8, 30, tzinfo=PARIS).timestamp() < 2 * 3600 + daily.STEP_S


@pytest.mark.integration
async def test_the_daily_summary_is_published_over_mqtt(tmp_path):
    """The summary event through a real alerter to a real mosquitto: event/daily_summary."""
    from tests.mosquitto import Broker, Collector

    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        pytest.fail("mosquitto is missing: scripts/install-system-deps installs it")
    write_night(tmp_path / "state", START)
    summary = daily.summary(cfg_for(tmp_path / "state"), START + 10 * 3600, READERS)
    broker = Broker(tmp_path / "broker")
    broker.start()
    try:
        from supervisor.core.config import MqttConfig

        cfg = MqttConfig(enabled=True, host="127.0.0.1", port=broker.port, keepalive_s=5, connect_timeout_s=20,
                         reconnect_initial_s=0.05, reconnect_max_s=0.5)
        async with Collector(broker, "sglang-supervisor/#") as sub:
            from tests.test_alerts import alerter as wired

            sink, alerter = wired(cfg, host="gpu-node-3", instance="kimi")
            await alerter.start()
            try:
                sink.emit(ev.DailySummary(**{**summary.fields(), "causes": tuple(summary.causes),
                                                "open_problems": tuple(summary.open_problems)}))
                (msg,) = await sub.wait_for(lambda: sub.on("/event/daily_summary"), what="the daily summary")
            finally:
                await alerter.aclose(20)
        body = json.loads(msg.payload)
        assert msg.topic == "sglang-supervisor/gpu-node-3/kimi/event/daily_summary"
        assert body["kind"] == "daily_summary" and "1 crash (cuda_oom_runtime x 1)" in body["message"]
        assert (body["mem_fraction_static"], body["next_mem_fraction_static"]) == (0.93, 0.88)
    finally:
        broker.stop()


def test_an_unknown_timezone_is_a_config_error_before_anything_starts(tmp_path):
    from supervisor.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"\[report\] timezone = 'Mars/Olympus_Mons': must be an IANA zone"):
        cfg_for(tmp_path, daily_at="08:30", timezone="Mars/Olympus_Mons")
    assert cfg_for(tmp_path, timezone="Europe/Paris").report.timezone == "Europe/Paris"


async def test_a_reload_sets_and_clears_daily_at(tmp_path):
    """The task follows the config in force: none at first (it only looks once a minute), then
    a reload to 08:30 sends one at 08:30, then a reload to "" sends no more."""
    clock = FakeClock(datetime(2026, 6, 1, 7, 0, tzinfo=PARIS).timestamp())
    now = {"cfg": cfg_for(tmp_path, timezone="Europe/Paris")}
    got: list[float] = []
    task = asyncio.create_task(daily.run(lambda: now["cfg"], lambda name, e: got.append(clock.t), clock=clock,
                                         readers=READERS, sleep=clock.sleep))
    while clock.t < datetime(2026, 6, 1, 8, 0, tzinfo=PARIS).timestamp():
        await asyncio.sleep(0)
    assert got == []
    now["cfg"] = cfg_for(tmp_path, daily_at="08:30", timezone="Europe/Paris")
    while not got:
        await asyncio.sleep(0)
    assert got == [datetime(2026, 6, 1, 8, 30, tzinfo=PARIS).timestamp()]
    now["cfg"] = cfg_for(tmp_path, timezone="Europe/Paris")
    while clock.t < datetime(2026, 6, 3, 9, 0, tzinfo=PARIS).timestamp():
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert len(got) == 1


def test_the_hosts_zone_keeps_its_dst_rules(monkeypatch):
    """No [report] timezone: $TZ or /etc/localtime as a zone with its rules, not today's offset."""
    monkeypatch.setenv("TZ", "Europe/Paris")
    tz = daily.zone("")
    winter = datetime(2026, 1, 15, 12, 0, tzinfo=tz).utcoffset()
    summer = datetime(2026, 7, 15, 12, 0, tzinfo=tz).utcoffset()
    assert (winter.total_seconds(), summer.total_seconds()) == (3600, 7200)
