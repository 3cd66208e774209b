"""The night in figures (supervisor/core/night.py): pure, from journal records and a window."""

from __future__ import annotations

from datetime import UTC, datetime, time
from zoneinfo import ZoneInfo

import pytest

from supervisor.core.night import next_daily, parse_duration, parse_time_of_day, summarize

T0 = 1_000_000.0


def rec(dt: float, kind: str, **fields: object) -> dict[str, object]:
    return {"t": T0 + dt, "kind": kind, **fields}


def changed(dt: float, frm: str, to: str) -> dict[str, object]:
    return rec(dt, "state_changed", **{"from": frm, "to": to, "reason": "r"})


# The demo night, in journal records: 0.93 launched, READY, OOM, BACKOFF, 0.88, READY.
DEMO = [
    rec(0, "daemon_started"),
    changed(0, "STOPPED", "STARTING"),
    rec(0, "launch", mem_fraction_static=0.93, attempt=1, pid=1),
    changed(100, "STARTING", "READY"),
    rec(100, "startup_facts", max_total_num_tokens=258992, avail_mem_after_capture_gb=0.82),
    changed(3590, "READY", "EXITED"),
    rec(3590, "server_down", pid=7, title="sglang::scheduler_TP0", phase="serving"),
    rec(3600, "crash", cause="cuda_oom_runtime", phase="serving", remedy="fraction_down", mem_fraction_static=0.93,
        next_mem_fraction_static=0.88, next_retry_s=2.0),
    changed(3601, "EXITED", "BACKOFF"),
    rec(3601, "restart_scheduled", delay_s=2.0, cause="cuda_oom_runtime", mem_fraction_static=0.88, attempt=2),
    changed(3603, "BACKOFF", "STARTING"),
    rec(3603, "launch", mem_fraction_static=0.88, attempt=2, pid=2),
    changed(3700, "STARTING", "READY"),
    rec(3700, "startup_facts", max_total_num_tokens=185649, avail_mem_after_capture_gb=5.62),
]


def test_the_demo_night_in_figures():
    """Serving time, time lost to the crash, the crash by cause, the fraction's step, the KV
    tokens at each rung and the headroom after capture at each launch."""
    n = summarize(DEMO, start=T0 - 3600, end=T0 + 7200, floor=0.8)
    assert n.start == T0  # the journal begins inside the window
    assert n.state == "READY"
    assert n.serving_s == pytest.approx((3590 - 100) + (7200 - 3700))
    assert n.serving_pct == pytest.approx(100 * 6990 / 7200)
    assert n.lost_crash_s == pytest.approx(110) and n.lost_restart_s == 0  # from the death, not the diagnosis
    assert n.crash_markers[0].t == T0 + 3590
    assert n.crashes == (("cuda_oom_runtime", 1),)
    assert [m.label for m in n.crash_markers] == ["cuda_oom_runtime (serving)"]
    assert [m.label for m in n.restart_markers] == ["fraction_down: restart at 0.88"]
    assert n.fraction_steps == ((T0, 0.93), (T0 + 3603, 0.88))
    assert (n.fraction_start, n.fraction_end, n.floor) == (0.93, 0.88, 0.8)
    assert n.kv_tokens_by_rung() == ((0.93, 258992), (0.88, 185649))
    assert [launch.avail_mem_after_capture_gb for launch in n.launches] == [0.82, 5.62]
    assert [b.state for b in n.bands] == ["STARTING", "READY", "EXITED", "BACKOFF", "STARTING", "READY"]
    assert n.open_problems == ()


def test_the_state_before_the_window_carries_into_it():
    """--since cuts the night: the band at the window's start is the state the journal had then."""
    n = summarize(DEMO, start=T0 + 1000, end=T0 + 7200, floor=0.8)
    assert n.bands[0].state == "READY" and n.bands[0].start == T0 + 1000
    assert n.fraction_start == 0.93 and n.fraction_steps[0] == (T0 + 1000, 0.93)


def test_an_open_give_up_and_a_crash_still_in_backoff_are_open_problems():
    gave_up = [*DEMO[:9], rec(3602, "gave_up", reason="gpu_hw_error on GPU 5", cause="gpu_hw_error",
                                mem_fraction_static=0.93, restarts=1), changed(3602, "BACKOFF", "GAVE_UP")]
    n = summarize(gave_up, start=T0, end=T0 + 7200, floor=0.8)
    assert [k for k, _ in n.open_problems] == ["gave_up"]
    assert n.lost_crash_s == pytest.approx(7200 - 3590)  # still down at the end
    in_backoff = DEMO[:9]
    assert [k for k, _ in summarize(in_backoff, start=T0, end=T0 + 3602, floor=0.8).open_problems] == ["crash"]
    warned = [*DEMO, rec(3800, "headroom_low", action="warn", avail_mem_gb=0.8, threshold_gb=2.0, rank="TP0")]
    assert [k for k, _ in summarize(warned, start=T0, end=T0 + 7200, floor=0.8).open_problems] == ["headroom_low"]


def test_stopped_on_purpose_is_not_counted_against_serving():
    stopped = [*DEMO, changed(5000, "READY", "STOPPING"), changed(5001, "STOPPING", "STOPPED")]
    n = summarize(stopped, start=T0, end=T0 + 7200, floor=0.8)
    assert n.supervised_s == pytest.approx(5000)
    assert n.serving_pct == pytest.approx(100 * (3490 + 1300) / 5000)
    assert n.shown_end < n.end


@pytest.mark.parametrize(("text", "seconds"), [("12h", 43200), ("90m", 5400), ("2d", 172800), ("30s", 30), ("6", 21600)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_bad_durations_and_times_are_refused():
    for bad in ("", "12x", "-1h", "0h"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    for bad in ("8", "8:3", "24:00", "ab:cd"):
        with pytest.raises(ValueError):
            t = parse_time_of_day(bad)
            assert t.hour < 24  # "24:00" passes the shape, not time()


PARIS = ZoneInfo("Europe/Paris")


def test_next_daily_is_today_if_still_ahead_else_tomorrow():
    now = datetime(2026, 3, 10, 7, 0, tzinfo=PARIS)
    assert next_daily(now, time(8, 30), PARIS) == datetime(2026, 3, 10, 8, 30, tzinfo=PARIS)
    later = datetime(2026, 3, 10, 8, 30, tzinfo=PARIS)  # exactly at: the next one is tomorrow's
    assert next_daily(later, time(8, 30), PARIS) == datetime(2026, 3, 11, 8, 30, tzinfo=PARIS)


def test_next_daily_keeps_the_wall_time_across_dst_changes():
    """Spring forward (29 March 2026 in Paris) the day is 23 h long; autumn back (25 October) 25 h:
    the summary still comes at 08:30 on the wall clock."""
    before_spring = datetime(2026, 3, 28, 9, 0, tzinfo=PARIS)
    spring = next_daily(before_spring, time(8, 30), PARIS)
    assert spring.replace(tzinfo=None) == datetime(2026, 3, 29, 8, 30)
    assert spring.utcoffset().total_seconds() == 7200  # CEST
    assert (spring.timestamp() - datetime(2026, 3, 28, 8, 30, tzinfo=PARIS).timestamp()) == 23 * 3600
    before_autumn = datetime(2026, 10, 24, 9, 0, tzinfo=PARIS)
    autumn = next_daily(before_autumn, time(8, 30), PARIS)
    assert autumn.replace(tzinfo=None) == datetime(2026, 10, 25, 8, 30)
    assert (autumn.timestamp() - datetime(2026, 10, 24, 8, 30, tzinfo=PARIS).timestamp()) == 25 * 3600


def test_next_daily_at_a_time_the_spring_change_skips():
    """02:30 does not exist on 29 March 2026 in Paris (02:00 -> 03:00): it comes at 03:30 CEST,
    once, and the next day at 02:30 again."""
    first = next_daily(datetime(2026, 3, 28, 12, 0, tzinfo=PARIS), time(2, 30), PARIS)
    assert first == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    assert first.astimezone(PARIS).strftime("%H:%M") == "03:30"
    second = next_daily(first, time(2, 30), PARIS)
    assert second.astimezone(PARIS).replace(tzinfo=None) == datetime(2026, 3, 30, 2, 30)


def test_next_daily_takes_a_now_in_any_zone():
    now_utc = datetime(2026, 1, 5, 7, 45, tzinfo=UTC)  # 08:45 in Paris: today's 08:30 has passed
    assert next_daily(now_utc, time(8, 30), PARIS) == datetime(2026, 1, 6, 8, 30, tzinfo=PARIS)


def test_what_to_do_now_is_the_alerts_wording_after_the_time():
    """An open give-up reads as its MQTT alert reads (alerts.describe), after the local time."""
    from zoneinfo import ZoneInfo

    from supervisor.report import todo_sentences
    from supervisor.sinks.alerts import describe

    t = datetime(2026, 11, 30, 3, 12, tzinfo=UTC).timestamp()
    records = [
        {"t": t - 60, "kind": "crash", "host": "gpu-node-3", "cause": "gpu_hw_error", "phase": "serving",
         "mem_fraction_static": 0.88, "next_retry_s": None},
        {"t": t, "kind": "gave_up", "host": "gpu-node-3", "reason": "gpu_hw_error on GPU 5 - reset the GPU",
         "cause": "gpu_hw_error", "mem_fraction_static": 0.88, "restarts": 1, "crashes": 1},
        {"t": t, "kind": "state_changed", "from": "EXITED", "to": "GAVE_UP", "reason": "r"},
    ]
    n = summarize(records, start=t - 3600, end=t + 3600, floor=0.8)
    (sentence,) = todo_sentences(n, records, instance="kimi", tz=ZoneInfo("UTC"))
    alert = describe("gave_up", records[1], host="gpu-node-3", instance="kimi")
    assert sentence == f"03:12: {alert}"
    assert sentence == "03:12: sglang kimi on gpu-node-3 gave up after 1 crash: gpu_hw_error on GPU 5 - reset the GPU; needs a human"
