"""The memory model, the recommended fraction and the climb (issue 25; docs/capacity.md).

The model's arithmetic is checked against numbers worked by hand: an 80 GB card where a
launch at 0.80 leaves 13.4 GB after CUDA-graph capture and one at 0.88 leaves 7.0 GB
(``avail(f) = 77.4 - 80 f``), KV tokens 185,649 and 232,061, and a serving peak that took
1.8 GB at 0.88 (least free 5.2 GB). With ``headroom_min_gb = 2`` and a 1 GB margin, f* is
the highest step with ``77.4 - 80 f - 1.8 >= 3``: ``f <= 0.9075``, so 0.90.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from supervisor.core.capacity import Line, MemoryModel, MemoryPoint, rank_gpus, recommend
from supervisor.core.config import Config, build_config, in_window
from supervisor.core.events import Event as SinkEvent
from supervisor.core.machine import step
from supervisor.core.messages import (
    Action,
    AskClimb,
    Boot,
    ClimbAllowed,
    Ctx,
    Diagnosed,
    Died,
    Emit,
    Event,
    FactsUpdated,
    GpuFree,
    KvPressure,
    Launch,
    Launched,
    Prepared,
    ProbeResult,
    SetTimer,
    StopServer,
    TimerFired,
)
from supervisor.core.model import Cause, Diagnosis, ExitStatus, Phase, RankFacts, StartupFacts, State
from supervisor.core.state import Core, Learned, Timer

KEY = "fleet/v1/kimi"


def facts(avail: dict[str, float], tokens: int, fraction: float | None = None) -> StartupFacts:
    ranks = {r: RankFacts(r, avail_mem_after_capture_gb=a, kv_cache_tokens=tokens) for r, a in avail.items()}
    return StartupFacts(ranks=ranks, progress="capture", mem_fraction_static=fraction)


def two_launches() -> MemoryModel:
    model = MemoryModel().launched(KEY, 0.80, facts({"TP0": 14.4, "TP1": 13.4}, 185_649))
    return model.launched(KEY, 0.88, facts({"TP0": 8.0, "TP1": 7.0}, 232_061))


def test_a_line_needs_two_distinct_fractions() -> None:
    assert Line.fit([(0.8, 1.0), (0.8, 2.0)]) is None
    line = Line.fit([(0.80, 13.4), (0.88, 7.0)])
    assert line is not None and line.slope == pytest.approx(-80.0) and line.at(0.9) == pytest.approx(5.4)


def test_the_recommendation_with_its_arithmetic() -> None:
    model = two_launches().served(0.88, {"TP0": 6.2, "TP1": 5.2})
    rec = recommend(model, current=0.88, floor_gb=3.0, step=0.01, ceiling=0.93, out_of_memory={0.93})
    assert rec.fraction == 0.90 and rec.rank == "TP1" and rec.limit == "the headroom"
    assert rec.headroom_gb == pytest.approx(77.4 - 80 * 0.90 - 1.8, abs=0.01)  # 3.6 GB
    assert rec.kv_tokens_now == 232_061
    assert rec.kv_tokens_at == round(185_649 + (232_061 - 185_649) / 0.08 * 0.10)  # the tokens line at 0.90
    assert rec.gain == pytest.approx(rec.kv_tokens_at / 232_061 - 1)
    words = rec.words()
    assert words.startswith("0.9 (now 0.88) would give +5 % KV tokens") and "(TP1)" in words, words


def test_a_fraction_that_ran_out_of_memory_is_a_ceiling() -> None:
    model = two_launches().served(0.88, {"TP0": 8.0, "TP1": 7.0})  # no transient at all
    rec = recommend(model, current=0.88, floor_gb=3.0, step=0.01, ceiling=0.95, out_of_memory={0.92, 0.96})
    assert rec.fraction == 0.91 and rec.limit == "the out-of-memory at 0.92"
    assert recommend(model, current=0.88, floor_gb=3.0, step=0.01, ceiling=0.89).fraction == 0.89


@pytest.mark.parametrize(("model", "missing"), [
    (MemoryModel(), "has none"),
    (MemoryModel().launched(KEY, 0.88, facts({"TP0": 7.0}, 232_061)), "has 0.88 only"),
    (two_launches(), "no load seen yet"),
])
def test_until_it_can_it_says_what_it_is_missing(model: MemoryModel, missing: str) -> None:
    rec = recommend(model, current=0.88, floor_gb=3.0, step=0.01, ceiling=0.93)
    assert rec.fraction is None and missing in rec.missing and rec.words().startswith("no recommended fraction yet")


def test_a_new_key_or_a_launch_the_model_mispredicts_starts_afresh() -> None:
    model = two_launches()
    assert [p.fraction for p in model.launched("fleet/v1/other", 0.85, facts({"TP0": 9.0}, 200_000)).points] == [0.85]
    upgraded = model.launched(KEY, 0.85, facts({"TP0": 10.4, "TP1": 9.4}, 150_000))  # line says ~214,657
    assert [p.fraction for p in upgraded.points] == [0.85]
    agrees = model.launched(KEY, 0.85, facts({"TP0": 10.4, "TP1": 9.4}, 214_700))
    assert sorted(p.fraction for p in agrees.points) == [0.80, 0.85, 0.88]


def test_the_least_free_memory_only_goes_down_and_in_steps() -> None:
    model = two_launches().served(0.88, {"TP1": 5.2})
    assert model.served(0.88, {"TP1": 5.18}) is model  # less than PEAK_STEP_GB lower
    assert model.served(0.88, {"TP1": 6.0}) is model
    assert model.served(0.88, {"TP1": 4.0}).point(0.88).least_free_gb == {"TP1": 4.0}  # type: ignore[union-attr]
    assert model.served(0.70, {"TP1": 1.0}) is model  # no launch known at 0.70


def test_the_model_survives_the_state_file() -> None:
    learned = Learned(0.88, 0, 0.93, 0, capacity=two_launches().served(0.88, {"TP1": 5.2}))
    back = Learned.from_dict(learned.to_dict())
    assert back.capacity == learned.capacity
    assert "capacity" not in Learned(0.88, 0, 0.93, 0).to_dict()  # nothing learned: the file as before
    assert MemoryPoint.from_dict(back.capacity.points[0].to_dict()) == back.capacity.points[0]


def test_ranks_map_to_gpu_positions() -> None:
    assert rank_gpus(["TP0", "TP1"]) == {"TP0": 0, "TP1": 1}
    assert rank_gpus(["main"]) == {"main": 0}
    assert rank_gpus(["DP0 TP0", "DP1 TP0"]) == {}


@pytest.mark.parametrize(("window", "minute", "inside"), [
    ("", 0, True), ("02:00-05:00", 3 * 60, True), ("02:00-05:00", 5 * 60, False),
    ("22:00-02:00", 23 * 60, True), ("22:00-02:00", 60, True), ("22:00-02:00", 12 * 60, False),
])
def test_the_climb_window_is_local_time_and_may_wrap(window: str, minute: int, inside: bool) -> None:
    assert in_window(window, minute) is inside


# --- the core: learning, KV pressure, the climb and its probation --------------------------


def cfg(**policy: Any) -> Config:
    return build_config({
        "server": {"model_path": "m", "tp_size": 2, "mem_fraction_static": 0.88},
        "policy": {"fraction_ladder": [0.93, 0.88, 0.85, 0.80], "stable_after_s": 600.0,
                   "backoff_jitter": 0.0, **policy},
        "gpu": {"headroom_min_gb": 2.0},
    })


class Server:
    """One core driven through launches at the fractions it chooses (avail(f) = 77.4 - 80 f,
    tokens linear), on a clock the test advances."""

    def __init__(self, config: Config, *, minute: int = 3 * 60) -> None:
        self.cfg = config
        self.core = Core.initial(Learned.initial(config))
        self.now = 1000.0
        self.minute = minute
        self.rng = random.Random(0)

    def send(self, event: Event, *, after: float = 0.0) -> list[Action]:
        self.now += after
        ctx = Ctx(now=self.now, cfg=self.cfg, rng=self.rng, wall_time="2026-12-02T03:00:00+00:00",
                  local_minute=self.minute)
        self.core, actions = step(self.core, event, ctx)
        return actions

    def launch_to_ready(self, actions: list[Action] | None = None) -> list[Action]:
        """PREPARING (or BACKOFF's timer) -> READY with this fraction's start-up facts."""
        if self.core.state is State.BACKOFF:
            self.send(TimerFired(Timer.BACKOFF), after=1.0)
        if self.core.state is State.STOPPED:
            self.send(Boot())
        launch = [a for a in self.send(Prepared()) if isinstance(a, Launch)]
        assert launch, self.core.state
        self.send(Launched(4242))
        f = self.core.learned.fraction
        assert f is not None
        learned = self.send(FactsUpdated(facts({"TP0": 78.4 - 80 * f, "TP1": 77.4 - 80 * f},
                                               round(-394_591 + 580_300 * f))))
        return learned + self.send(ProbeResult(ok=True), after=30.0)

    def died(self, cause: Cause) -> list[Action]:
        actions = self.send(Died(ExitStatus(signal=9)))
        return actions + self.send(Diagnosed(ExitStatus(signal=9), Diagnosis(cause, Phase.SERVING, ("x",))))


def emitted(actions: list[Action], kind: type[SinkEvent]) -> list[Any]:
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, kind)]


def learned_two_fractions(config: Config) -> Server:
    """Launched at 0.88 and, after a runtime OOM there, at 0.85: the model has two points."""
    server = Server(config)
    server.launch_to_ready()
    server.died(Cause.CUDA_OOM_RUNTIME)
    assert server.core.learned.fraction == 0.85
    server.launch_to_ready()
    return server


def test_the_core_learns_each_launch_and_tells_the_recommendation() -> None:
    from supervisor.core.events import Recommended

    server = Server(cfg())
    first = server.launch_to_ready()
    (told,) = emitted(first, Recommended)  # once: at the facts, not again at READY
    assert told.fraction is None and "0.88 only" in told.missing
    server.died(Cause.CUDA_OOM_RUNTIME)
    server.launch_to_ready()
    assert len(server.core.learned.capacity.points) == 2
    changed = server.send(GpuFree((10.0, 8.0)))  # TP1 least free 8.0 at 0.85: 1.4 GB transient
    (rec,) = emitted(changed, Recommended)
    # 77.4 - 80 f - 1.4 >= 3, below the OOM at 0.88: 0.87 (ceiling), not 0.9
    assert rec.fraction == 0.87 and rec.rank == "TP1" and "out-of-memory at 0.88" in rec.words
    assert server.send(GpuFree((10.0, 7.99))) == []  # not lower by a step: nothing written


def test_kv_pressure_is_an_event_at_most_once_a_minute_with_the_signals_in_between() -> None:
    from supervisor.core.events import KvPressureSeen

    server = Server(cfg())
    server.launch_to_ready()
    first = emitted(server.send(KvPressure("retraction", "#retracted_reqs: 3")), KvPressureSeen)
    assert [e.signals for e in first] == [1]
    assert emitted(server.send(KvPressure("retraction", "again"), after=10.0), KvPressureSeen) == []
    later = emitted(server.send(KvPressure("metrics", "token_usage 0.99, queue 12"), after=60.0), KvPressureSeen)
    assert [(e.signals, e.source) for e in later] == [(2, "metrics")]


def climbing(**policy: Any) -> Server:
    server = learned_two_fractions(cfg(climb=True, **policy))
    server.send(GpuFree((9.0, 8.0)))  # 1.4 GB transient at 0.85
    return server


def test_no_climb_without_kv_pressure_or_before_stable() -> None:
    server = climbing(climb_window="02:00-05:00")
    assert not [a for a in server.send(TimerFired(Timer.STABLE), after=600.0) if isinstance(a, AskClimb)]
    early = climbing()
    assert not [a for a in early.send(KvPressure("retraction", "x"), after=10.0) if isinstance(a, AskClimb)]


def test_a_server_alone_climbs_only_inside_its_window() -> None:
    outside = climbing(climb_window="02:00-05:00")
    outside.minute = 12 * 60
    outside.send(TimerFired(Timer.STABLE), after=600.0)
    assert not [a for a in outside.send(KvPressure("retraction", "x"), after=1.0) if isinstance(a, AskClimb)]
    inside = climbing(climb_window="02:00-05:00")
    inside.send(TimerFired(Timer.STABLE), after=600.0)
    assert [a for a in inside.send(KvPressure("retraction", "x"), after=1.0) if isinstance(a, AskClimb)] == [AskClimb(0.87)]


def test_the_climb_is_a_drained_restart_at_once_and_a_probation() -> None:
    from supervisor.core.events import Climbed, ClimbKept, RestartScheduled

    server = climbing()
    server.send(TimerFired(Timer.STABLE), after=600.0)
    server.send(KvPressure("retraction", "x"), after=1.0)
    actions = server.send(ClimbAllowed(0.87))
    assert server.core.state is State.RESTARTING and [a.mode for a in actions if isinstance(a, StopServer)] == ["drain"]
    (climbed,) = emitted(actions, Climbed)
    assert (climbed.mem_fraction_before, climbed.mem_fraction_static) == (0.85, 0.87)
    assert climbed.kv_tokens_gain == pytest.approx((-394_591 + 580_300 * 0.87) / (-394_591 + 580_300 * 0.85) - 1, abs=1e-3)
    server.send(Died(ExitStatus(code=0)))
    after = server.send(Diagnosed(ExitStatus(code=0), None))
    (restart,) = emitted(after, RestartScheduled)
    assert (restart.delay_s, restart.mem_fraction_before, restart.mem_fraction_static) == (0.0, 0.85, 0.87)
    assert server.core.climb_from == 0.85
    ready = server.launch_to_ready()
    (probation,) = [a for a in ready if isinstance(a, SetTimer) and a.name is Timer.PROBATION]
    assert 0 < probation.delay_s <= server.cfg.policy.probation_s
    kept = server.send(TimerFired(Timer.PROBATION), after=probation.delay_s)
    assert emitted(kept, ClimbKept) and server.core.climb_from is None
    # one climb per climb_interval_s
    server.send(TimerFired(Timer.STABLE), after=600.0)
    assert not [a for a in server.send(KvPressure("retraction", "x"), after=1.0) if isinstance(a, AskClimb)]


def test_a_climb_that_fails_on_probation_falls_back_at_once_and_the_fraction_becomes_a_ceiling() -> None:
    from supervisor.core.events import ClimbFellBack, Recommended, RestartScheduled

    server = climbing()
    server.send(TimerFired(Timer.STABLE), after=600.0)
    server.send(KvPressure("retraction", "x"), after=1.0)
    server.send(ClimbAllowed(0.87))
    server.send(Died(ExitStatus(code=0)))
    server.send(Diagnosed(ExitStatus(code=0), None))
    server.launch_to_ready()
    failed = server.died(Cause.CUDA_OOM_RUNTIME)
    (fell,) = emitted(failed, ClimbFellBack)
    assert (fell.mem_fraction_failed, fell.mem_fraction_static) == (0.87, 0.85)
    (restart,) = emitted(failed, RestartScheduled)
    assert (restart.delay_s, restart.mem_fraction_static) == (0.0, 0.85)
    assert 0.87 in server.core.learned.oom_fractions
    ready = server.launch_to_ready()
    (rec,) = emitted(ready, Recommended)
    assert rec.fraction is not None and rec.fraction < 0.87  # never past the fraction that failed


def test_a_climb_request_that_no_longer_holds_is_ignored() -> None:
    server = climbing()
    assert server.send(ClimbAllowed(0.87)) == []  # no pressure, not stable yet
    assert server.core.state is State.READY


# --- the shell's readings: SGLang's retraction lines and its /metrics ------------------------


def test_retraction_lines_are_spotted_in_reads_without_splitting_lines() -> None:
    from types import SimpleNamespace

    from supervisor.adapters.process import ServerProcess
    from supervisor.unit.life import SPOTTED

    seen: list[str] = []
    data = (b"[2026-12-02 03:00:01 TP0] Decode batch, #running-req: 40, token usage: 0.99\n"
            b"[2026-12-02 03:00:01 TP0] KV cache pool is full. Retract requests. #retracted_reqs: 3, "
            b"#new_tokens_gained: 2048, #new_token_ratio: 0.7000 -> 1.0000\r\n"
            b"[2026-12-02 03:00:02 TP1] Decode out of memory happened. #retracted_reqs: 1, #new_token_ratio: 0.5 -> 1.0\n"
            b"[2026-12-02 03:00:03 TP0] retract_decode: aborted last request 5f3c due to OOM\n"
            b"[2026-12-02 03:00:04 TP0] Testing retraction. #retracted_reqs: 0, #new_tokens_gained: 0\n")
    ServerProcess._spot(SimpleNamespace(spotted=SPOTTED), data, len(data), seen.append)  # type: ignore[arg-type]
    assert [line.split("] ")[1][:20] for line in seen] == [
        "KV cache pool is ful", "Decode out of memory", "Testing retraction. ", "retract_decode: abor"]
    assert seen[0].endswith("1.0000") and "#retracted_reqs: 3" in seen[0]


@pytest.mark.parametrize("before", [b"", b"x" * 5000 + b"\n", b"a_b\n", b"tp_rank 3 retracted_reqs\n", b"_" * 3])
def test_a_spotted_word_is_found_wherever_its_rare_byte_first_appears(before: bytes) -> None:
    """A word is searched from its rarest byte's first place (``_`` in both of SGLang's): an
    ``_`` in other text before it, one just in front of it, or none in the read at all (then
    nothing is searched) never loses a line that holds it; the read's bound ``n`` is kept."""
    from types import SimpleNamespace

    from supervisor.adapters.process import ServerProcess, _pivot
    from supervisor.unit.life import SPOTTED

    assert all(_pivot(word)[0] == b"_" for word in SPOTTED)
    line = b"[TP0] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 9\n"
    flood = b"[TP0] Decode batch. #running-req: 40, #token: 900, token usage: 0.99, #queue-req: 0, \n" * 50
    for data in (before + line + flood, flood + before + line, before + flood):
        seen: list[str] = []
        spotter = SimpleNamespace(spotted=SPOTTED)
        ServerProcess._spot(spotter, data + line, len(data), seen.append)  # type: ignore[arg-type]
        assert len(seen) == data.count(b"#retracted_reqs: 2"), (before, seen)
        assert all("#retracted_reqs: 2" in s for s in seen)


def test_a_retraction_that_retracted_nothing_is_no_pressure_and_the_source_is_named() -> None:
    from types import SimpleNamespace

    from supervisor.unit.life import ServerLife

    posted: list[Any] = []
    life = SimpleNamespace(_post=posted.append)
    run = SimpleNamespace(spotted_at=-1e9)  # the launch's record (LaunchLife)
    ServerLife._on_spotted(life, run, "[TP0] Testing retraction. #retracted_reqs: 0, #new_tokens_gained: 0")  # type: ignore[arg-type]
    assert posted == []
    ServerLife._on_spotted(life, run, "[TP0] retract_decode: aborted last request 5f due to OOM")  # type: ignore[arg-type]
    assert [p.source for p in posted] == ["refused"]


def test_sglang_kv_gauges_are_read_from_its_metrics_page() -> None:
    from supervisor.adapters.health import parse_kv_gauges

    page = (b'# HELP sglang:token_usage The token usage.\n# TYPE sglang:token_usage gauge\n'
            b'sglang:token_usage{engine_type="unified",model_name="tiny",tp_rank="0"} 0.97\n'
            b'sglang:token_usage{engine_type="unified",model_name="tiny",tp_rank="1"} 0.42\n'
            b'sglang:token_usage_total 5.0\n'
            b'sglang:num_queue_reqs{engine_type="unified",model_name="tiny",tp_rank="0"} 7.0\n'
            b'sglang:num_queue_reqs{engine_type="unified",model_name="tiny",tp_rank="1"} 2.0\n')
    assert parse_kv_gauges(page) == (0.97, 9)
    assert parse_kv_gauges(b"sglang:num_queue_reqs 3\n") is None  # no usage: nothing to judge


def test_a_full_pool_with_a_queue_that_does_not_shrink_is_pressure_a_full_pool_alone_is_not() -> None:
    from supervisor.core.events import KvPressureSeen
    from supervisor.core.messages import KvSample

    server = Server(cfg())
    server.launch_to_ready()
    assert server.send(KvSample(0.99, 5)) == []  # the first reading: nothing to compare
    assert server.send(KvSample(0.99, 3), after=10.0) == []  # full, but the queue drains
    assert server.send(KvSample(0.99, 0), after=10.0) == []  # full, nobody waits
    assert server.send(KvSample(0.50, 9), after=10.0) == []  # the queue grows, the pool has room
    (seen,) = emitted(server.send(KvSample(0.98, 12), after=10.0), KvPressureSeen)
    assert seen.source == "metrics" and "#queue-req 12" in seen.detail


def test_probes_read_sglang_metrics_only_when_it_serves_them() -> None:
    from supervisor.core.messages import Probe

    plain = Server(cfg())
    plain.launch_to_ready()
    assert [a for a in plain.send(TimerFired(Timer.PROBE), after=10.0) if isinstance(a, Probe)] == [Probe(read_kv=False)]
    metrics = Server(build_config({"server": {"model_path": "m", "mem_fraction_static": 0.88,
                                              "extra_args": ["--enable-metrics"]}}))
    metrics.launch_to_ready()
    assert [a for a in metrics.send(TimerFired(Timer.PROBE), after=10.0) if isinstance(a, Probe)] == [Probe(read_kv=True)]


def test_without_cuda_graphs_the_memory_left_after_the_pool_counts_once_ready() -> None:
    """The CPU (and --disable-cuda-graph) captures nothing: the pool's line is the last word,
    but only once the server is ready (before, a capture line may still come)."""
    from supervisor.core.capacity import left_after_start

    ranks = {"main": RankFacts("main", avail_mem_after_pool_gb=20.46, kv_cache_tokens=4096)}
    assert left_after_start(StartupFacts(ranks=ranks, progress="kv_pool")) == {}
    ready = StartupFacts(ranks=ranks, progress="ready", ready=True)
    assert left_after_start(ready) == {"main": 20.46}
    assert [p.kv_tokens for p in MemoryModel().launched(KEY, 0.2, ready).points] == [4096]


def test_until_the_model_can_say_a_climb_is_one_step_up_and_never_past_a_ceiling() -> None:
    """One fraction known (or no serving peak): one ``climb_step`` up, which also gives the
    model its second point; never to or past a fraction that ran out of memory."""
    server = Server(cfg(climb=True))
    server.launch_to_ready()
    server.send(TimerFired(Timer.STABLE), after=600.0)
    assert [a for a in server.send(KvPressure("retraction", "x"), after=1.0) if isinstance(a, AskClimb)] == [AskClimb(0.89)]
    walled = Server(cfg(climb=True))
    walled.core = Core.initial(Learned(0.88, 0, 0.88, 0, oom_fractions=frozenset({0.89})))
    walled.launch_to_ready()
    walled.send(TimerFired(Timer.STABLE), after=600.0)
    assert not [a for a in walled.send(KvPressure("retraction", "x"), after=1.0) if isinstance(a, AskClimb)]


def test_the_metrics_show_the_recommendation_the_pressure_and_the_climbs() -> None:
    from prometheus_client import CollectorRegistry

    from supervisor.core.events import Climbed, ClimbFellBack, KvPressureSeen, Recommended
    from supervisor.sinks.metrics import Metrics

    registry = CollectorRegistry()
    metrics = Metrics(registry=registry)
    value = registry.get_sample_value
    metrics.emit(Recommended(fraction=None, mem_fraction_static=0.88, kv_tokens_now=None, kv_tokens_at=None,
                             headroom_gb=None, rank="", missing="no load seen yet", words="", points=1))
    assert value("sglang_supervisor_recommended_fraction") != value("sglang_supervisor_recommended_fraction")  # NaN
    metrics.emit(Recommended(fraction=0.91, mem_fraction_static=0.88, kv_tokens_now=185_649, kv_tokens_at=229_657,
                             headroom_gb=2.4, rank="TP3", missing="", words="", points=2))
    assert value("sglang_supervisor_recommended_fraction") == 0.91
    assert value("sglang_supervisor_predicted_kv_tokens") == 229_657
    metrics.emit(KvPressureSeen(source="retraction", detail="x", signals=3, mem_fraction_static=0.88))
    assert value("sglang_supervisor_kv_pressure_total", {"source": "retraction"}) == 3
    assert value("sglang_supervisor_kv_pressure_total", {"source": "metrics"}) == 0
    metrics.emit(Climbed(mem_fraction_before=0.88, mem_fraction_static=0.91, kv_tokens_gain=0.19, words=""))
    metrics.emit(ClimbFellBack(mem_fraction_failed=0.91, mem_fraction_static=0.88, cause=Cause.CUDA_OOM_RUNTIME))
    assert value("sglang_supervisor_climbs_total", {"outcome": "climbed"}) == 1
    assert value("sglang_supervisor_climbs_total", {"outcome": "fell_back"}) == 1


def test_the_least_free_memory_of_each_gpu_goes_to_the_core_when_it_falls_by_a_step() -> None:
    from types import SimpleNamespace

    from supervisor.core.events import GpuSample
    from supervisor.core.messages import GpuFree
    from supervisor.unit.life import GIB, ServerLife

    life = SimpleNamespace(run=SimpleNamespace(least_free=()))  # the launch's record (LaunchLife)

    def sample(*free_gb: float) -> GpuSample:
        return GpuSample(gpus=tuple({"index": i, "free_bytes": int(f * GIB)} for i, f in enumerate(free_gb)))

    least = ServerLife.least_free
    assert least(life, sample(10.0, 9.0)) == GpuFree((10.0, 9.0))  # type: ignore[arg-type]
    assert least(life, sample(10.0, 8.99)) is None  # type: ignore[arg-type]  # less than a step lower
    assert least(life, sample(11.0, 8.5)) == GpuFree((10.0, 8.5))  # type: ignore[arg-type]  # least, per GPU
    life.run = SimpleNamespace(least_free=())  # a new launch, a new record: it starts afresh
    assert least(life, sample(12.0, 12.0)) == GpuFree((12.0, 12.0))  # type: ignore[arg-type]
