"""The night in figures (supervisor/core/night.py): pure, from journal records and a window."""

from __future__ import annotations

from datetime import UTC, datetime, time
from zoneinfo import ZoneInfo

import pytest

from supervisor.core.night import (
    ClimbStep,
    kv_pressure,
    next_daily,
    parse_duration,
    parse_time_of_day,
    recommendation,
    summarize,
)

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


WORDS_091 = ("0.91 (now 0.88) would give +19 % KV tokens (220,922) and leave 2.4 GB at the observed peak on the "
             "tightest rank (TP3); headroom stops it higher")
WORDS_090 = ("0.9 (now 0.88) would give +12 % KV tokens (207,927) and leave 3.1 GB at the observed peak on the "
             "tightest rank (TP3); out-of-memory at 0.91 stops it higher")

WORDS_KEEP = ("0.9 (now 0.9) would give +0 % KV tokens (207,927) and leave 3.1 GB at the observed peak on the "
              "tightest rank (TP3); out-of-memory at 0.91 stops it higher")


def recommended(dt: float, fraction: float | None, words: str, **fields: object) -> dict[str, object]:
    return rec(dt, "recommended_fraction", fraction=fraction, rank="TP3", words=words, points=2,
               **{"mem_fraction_static": 0.88, "kv_tokens_now": 185649, "kv_tokens_at": None, "headroom_gb": None,
                  "missing": "", **fields})


def relaunch(dt: float, fraction: float, attempt: int, cause: str, frm: str) -> list[dict[str, object]]:
    """``frm`` -> BACKOFF, the restart at once at ``fraction``, READY two minutes later."""
    return [changed(dt, frm, "BACKOFF"),
            rec(dt, "restart_scheduled", delay_s=0.0, cause=cause, mem_fraction_static=fraction, attempt=attempt),
            changed(dt + 1, "BACKOFF", "STARTING"),
            rec(dt + 1, "launch", mem_fraction_static=fraction, attempt=attempt, pid=attempt),
            changed(dt + 120, "STARTING", "READY")]


# After the demo night, at 0.88: KV pressure, the model recommends 0.91, a climb to 0.91 that
# dies of a CUDA OOM on probation and falls back to 0.88 (0.91 a ceiling now: 0.9 recommended),
# more pressure, a climb to 0.9 that is kept after its 30 min probation.
CLIMBS = [
    *DEMO,
    rec(4000, "kv_pressure", source="retraction", detail="#retracted_reqs: 3", signals=3, mem_fraction_static=0.88),
    recommended(4100, 0.91, WORDS_091, kv_tokens_at=220922, headroom_gb=2.4),
    rec(4200, "kv_pressure", source="metrics", detail="token_usage 0.99, #queue-req 12", signals=2,
        mem_fraction_static=0.88),
    rec(4260, "climb", mem_fraction_before=0.88, mem_fraction_static=0.91, kv_tokens_gain=0.19, words=WORDS_091),
    changed(4260, "READY", "RESTARTING"),
    *relaunch(4265, 0.91, 3, "climb", "RESTARTING"),  # READY at 4385
    changed(4800, "READY", "EXITED"),
    rec(4800, "server_down", pid=3, title="sglang::scheduler_TP3", phase="serving"),
    rec(4805, "crash", cause="cuda_oom_runtime", phase="serving", remedy="fraction_down", mem_fraction_static=0.91,
        next_mem_fraction_static=0.88, next_retry_s=0.0),
    rec(4805, "climb_fell_back", mem_fraction_failed=0.91, mem_fraction_static=0.88, cause="cuda_oom_runtime"),
    *relaunch(4806, 0.88, 4, "cuda_oom_runtime", "EXITED"),  # READY at 4926
    recommended(4926, 0.9, WORDS_090, kv_tokens_at=207927, headroom_gb=3.1),
    rec(5400, "kv_pressure", source="retraction", detail="#retracted_reqs: 1", signals=1, mem_fraction_static=0.88),
    rec(5460, "climb", mem_fraction_before=0.88, mem_fraction_static=0.9, kv_tokens_gain=0.12, words=WORDS_090),
    changed(5460, "READY", "RESTARTING"),
    *relaunch(5465, 0.9, 5, "climb", "RESTARTING"),  # READY at 5585
    recommended(5585, 0.9, WORDS_KEEP, mem_fraction_static=0.9, kv_tokens_now=207927, kv_tokens_at=207927,
                headroom_gb=3.1),
    rec(7385, "climb_kept", mem_fraction_static=0.9, probation_s=1800.0),
]


def test_a_night_with_climbs_in_figures():
    """The last recommendation, the KV pressure summed by source, each climb, fall-back and
    keeping; a climb's drained restart is time lost to restarts, drawn by the climb's own
    marker (not a restart triangle labelled with the last crash's remedy)."""
    n = summarize(CLIMBS, start=T0, end=T0 + 9000, floor=0.8)
    advice = n.recommended
    assert advice is not None and advice.t == T0 + 5585
    assert (advice.fraction, advice.current, advice.direction, advice.words) == (0.9, 0.9, "keep", WORDS_KEEP)
    assert advice.gain == 0
    before = summarize(CLIMBS, start=T0, end=T0 + 5500, floor=0.8).recommended  # before the climb to 0.9
    assert before is not None and (before.fraction, before.current, before.direction) == (0.9, 0.88, "raise")
    assert before.gain == pytest.approx(207927 / 185649 - 1)
    kv = n.kv_pressure
    assert kv is not None and kv.signals == 6 and kv.by_source == (("retraction", 4), ("metrics", 2))
    assert (kv.last_t, kv.last_source, kv.last_fraction) == (T0 + 5400, "retraction", 0.88)
    assert n.climbs == (
        ClimbStep(T0 + 4260, "climb", 0.91, before=0.88, gain=0.19),
        ClimbStep(T0 + 4805, "fell_back", 0.88, before=0.91, cause="cuda_oom_runtime"),
        ClimbStep(T0 + 5460, "climb", 0.9, before=0.88, gain=0.12),
        ClimbStep(T0 + 7385, "kept", 0.9, probation_s=1800.0),
    )
    assert [m.label for m in n.restart_markers] == ["fraction_down: restart at 0.88"] * 2
    assert n.lost_restart_s == pytest.approx((4385 - 4260) + (5585 - 5460))  # from the climb to READY
    assert n.lost_crash_s == pytest.approx(110 + (4926 - 4800))
    assert [f for _, f in n.fraction_steps] == [0.93, 0.88, 0.91, 0.88, 0.9]
    assert n.crashes == (("cuda_oom_runtime", 2),)


def test_without_the_memory_models_records_there_is_nothing_to_say():
    n = summarize(DEMO, start=T0, end=T0 + 7200, floor=0.8)
    assert (n.recommended, n.kv_pressure, n.climbs) == (None, None, ())


def test_the_last_recommendation_said_holds_until_another_is_said():
    """Said when it changes: the last one before the window still holds in it (with its own
    time); one said after ``end`` is not yet said; none said, None."""
    told = [recommended(100, None, "no recommended fraction yet: needs start-up facts from launches at two different "
                        "fractions (has 0.88 only)", missing="needs start-up facts from launches at two different "
                        "fractions (has 0.88 only)"),
            recommended(9000, 0.91, WORDS_091)]
    early = recommendation(told, end=T0 + 5000)
    assert early is not None and early.t == T0 + 100 and early.fraction is None and early.direction == ""
    assert early.missing.startswith("needs start-up facts") and early.gain is None
    later = recommendation(told, end=T0 + 9000)
    assert later is not None and later.fraction == 0.91
    assert recommendation(DEMO, end=T0 + 9000) is None
    assert summarize([*DEMO, *told], start=T0 + 1000, end=T0 + 7200, floor=0.8).recommended == early


def test_kv_pressure_counts_a_record_without_its_count_as_one():
    kv = kv_pressure([rec(10, "kv_pressure", source="metrics", detail="d", mem_fraction_static=0.88),
                      rec(5, "kv_pressure", source="retraction", detail="e", signals=4, mem_fraction_static=None)])
    assert kv is not None and kv.signals == 5 and kv.by_source == (("retraction", 4), ("metrics", 1))
    assert (kv.last_t, kv.last_detail, kv.last_fraction) == (T0 + 10, "d", 0.88)
    assert kv_pressure(DEMO) is None


def test_a_planned_restart_after_a_crash_is_labelled_with_its_own_cause():
    """An operator's restart later in the night is not the last crash's remedy."""
    restarted = [*DEMO, rec(5000, "restart_requested"), changed(5000, "READY", "RESTARTING"),
                 *relaunch(5005, 0.88, 3, "operator_restart", "RESTARTING")]
    n = summarize(restarted, start=T0, end=T0 + 7200, floor=0.8)
    assert [m.label for m in n.restart_markers] == ["fraction_down: restart at 0.88",
                                                    "operator_restart: restart at 0.88"]


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

    from supervisor.core.events import from_fields
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
    alert = describe(from_fields("gave_up", {k: v for k, v in records[1].items() if k not in ("t", "kind")}),
                     host="gpu-node-3", instance="kimi")
    assert sentence == f"03:12: {alert}"
    assert sentence == "03:12: sglang kimi on gpu-node-3 gave up after 1 crash: gpu_hw_error on GPU 5 - reset the GPU; needs a human"
