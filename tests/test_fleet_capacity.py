"""The memory model shared with the fleet (issue 25, item 1; docs/capacity.md, docs/fleet.md).

With ``[fleet]`` on, the record at a configuration's fleet key holds, besides the rung and
the OOMs, the memory model's points (start-up facts and serving peaks per fraction) and the
highest fraction a climb kept past its probation. A server learns from launches it never
made: a first launch at a fraction the fleet already knows gives it a recommendation at
once. The fleet's rung never undoes a climb on probation or a kept one; a climb that fails
tells the fleet the fraction it fell back to. The merge rules are pure; the last test runs
two daemons' fleet services against a real etcd.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from typing import Any

from supervisor.adapters.etcd import EtcdClient
from supervisor.adapters.ports import GpuInfo
from supervisor.core import events as ev
from supervisor.core.capacity import POINTS_KEPT, MemoryModel, MemoryPoint, merge_points
from supervisor.core.config import Config, build_config
from supervisor.core.fleet import FLEET_PREFIX, FleetOom, FleetRecord, merge
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
    FleetAdvice,
    FleetShare,
    GpuFree,
    KvPressure,
    Launch,
    Launched,
    Prepared,
    ProbeResult,
    TimerFired,
)
from supervisor.core.model import Cause, ExitStatus, State
from supervisor.core.state import Core, Learned, Timer
from supervisor.services.fleet_sync import FleetSync
from tests.etcdlib import EtcdServer, etcd_server  # noqa: F401 - a fixture
from tests.test_capacity import Server, facts

KEY = f"{FLEET_PREFIX}/m/0.5.23/NVIDIA_H200-143771MiB/tp2-dp1-pp1-ep1-n1/abcdef012345"


def point(f: float, least: dict[str, float] | None = None) -> MemoryPoint:
    """Launches on the same model as tests.test_capacity.Server: avail(f) = 78.4/77.4 - 80 f."""
    return MemoryPoint(f, round(-394_591 + 580_300 * f), {"TP0": round(78.4 - 80 * f, 3), "TP1": round(77.4 - 80 * f, 3)},
                       least or {})


def fleet_cfg(**policy: Any) -> Config:
    return build_config({
        "server": {"model_path": "m", "tp_size": 2, "mem_fraction_static": 0.88},
        "policy": {"fraction_ladder": [0.93, 0.88, 0.85, 0.80], "stable_after_s": 600.0, "backoff_jitter": 0.0,
                   **policy},
        "gpu": {"headroom_min_gb": 2.0},
        "etcd": {"endpoints": ["127.0.0.1:2379"]},
        "fleet": {"enabled": True},
    })


def emitted(actions: list[Action], kind: type[ev.Event]) -> list[Any]:
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, kind)]


def shares(actions: list[Action]) -> list[FleetShare]:
    return [a for a in actions if isinstance(a, FleetShare)]


class FleetServer(Server):
    """tests.test_capacity's server, with the fleet's advice read before each launch."""

    def __init__(self, config: Config, advice: FleetAdvice) -> None:
        super().__init__(config)
        self.advice = advice
        self.shared: list[FleetShare] = []

    def send(self, event: Any, *, after: float = 0.0) -> list[Action]:
        actions = super().send(event, after=after)
        if self.core.state is State.PREPARING and not isinstance(event, FleetAdvice):
            actions += super().send(self.advice)  # what the shell's preparation reads first
        self.shared += shares(actions)
        return actions


# --- the merge rules (pure) ---------------------------------------------------------------------


def test_points_merge_one_per_fraction_with_the_newer_facts_and_the_highest_peak() -> None:
    old = [point(0.80, {"TP0": 12.0, "TP1": 10.0}), point(0.85)]
    new = [replace(point(0.80, {"TP0": 13.0, "TP1": 9.5}), kv_tokens=70_000)]
    merged = merge_points(old, new)
    assert [p.fraction for p in merged] == [0.85, 0.80]  # the newer list's last
    (at80,) = [p for p in merged if p.fraction == 0.80]
    assert at80.kv_tokens == 70_000 and at80.least_free_gb == {"TP0": 12.0, "TP1": 9.5}
    many = merge_points([point(0.70 + i / 100) for i in range(POINTS_KEPT)], [point(0.90)])
    assert len(many) == POINTS_KEPT and many[0].fraction == 0.71 and many[-1].fraction == 0.90


def test_a_model_joins_the_fleets_points_but_keeps_its_own_facts_and_skips_what_disagrees() -> None:
    ours = MemoryModel().launched(KEY, 0.85, facts({"TP0": 10.4, "TP1": 9.4}, 98_664))
    disagrees = replace(point(0.80), kv_tokens=1_000)  # another machine the key did not name
    theirs = (point(0.80, {"TP0": 12.0, "TP1": 11.0}), replace(point(0.85), kv_tokens=98_000,
                                                               least_free_gb={"TP1": 8.0}), disagrees)
    joined = ours.joined(KEY, theirs[:2], kept=0.87)
    assert sorted(p.fraction for p in joined.points) == [0.80, 0.85] and joined.kept == 0.87
    (at85,) = [p for p in joined.points if p.fraction == 0.85]
    assert at85.kv_tokens == 98_664 and at85.least_free_gb == {"TP1": 8.0}  # our facts, their peak
    two = MemoryModel().launched(KEY, 0.85, facts({"TP0": 10.4, "TP1": 9.4}, 98_664)).joined(KEY, theirs[:1])
    assert two.joined(KEY, [replace(disagrees, fraction=0.75)]) == two  # mispredicted: not taken
    assert ours.joined("other", theirs[:1]).key == "other"
    assert ours.joined(KEY, (), kept=None).kept is None and joined.joined(KEY, (), kept=0.86).kept == 0.87


def test_the_record_keeps_points_and_the_highest_kept_fraction_until_an_oom_at_or_below_it() -> None:
    record = merge(None, KEY, [], "T0", [point(0.80)], kept=0.84)
    record = merge(record, KEY, [], "T1", [point(0.84)], kept=0.83)
    assert [p.fraction for p in record.points] == [0.80, 0.84] and record.kept == 0.84 and record.rung is None
    again = FleetRecord.from_json(KEY, record.to_json())
    assert again.points == record.points and again.kept == 0.84
    above = merge(record, KEY, [FleetOom(0.86, 0.84, "T2", "cuda_oom_runtime", "s", "c")], "T2")
    assert above.kept == 0.84 and above.rung == 0.84
    below = merge(above, KEY, [FleetOom(0.84, 0.80, "T3", "cuda_oom_runtime", "s", "c")], "T3")
    assert below.kept is None and below.rung == 0.80
    old = FleetRecord.from_json(KEY, b'{"version": 1, "key": "k", "rung": 0.88, "ooms": [], "updated": "T"}')
    assert old.points == () and old.kept is None  # a record written before points existed


# --- the core ------------------------------------------------------------------------------------


def test_the_fleets_points_give_a_first_launch_its_recommendation_and_ours_go_back() -> None:
    from supervisor.core.events import Recommended

    record_points = (point(0.80, {"TP0": 14.4, "TP1": 12.0}), point(0.85))
    server = FleetServer(fleet_cfg(), FleetAdvice(KEY, points=record_points))
    boot = server.send(Boot())
    (told,) = emitted(boot, Recommended)  # before its own first launch: from the fleet's two points
    assert told.fraction is not None and told.points == 2 and not told.missing
    assert not server.shared  # the record holds all the model knows
    server.launch_to_ready()  # its own launch at 0.88: a third point, shared
    assert len(server.core.learned.capacity.points) == 3
    last = server.shared[-1]
    assert last.model_key == KEY and sorted(p.fraction for p in last.points) == [0.80, 0.85, 0.88]


def test_a_launch_whose_record_lacks_our_points_shares_them() -> None:
    cfg = fleet_cfg()
    learned = replace(Learned.initial(cfg), capacity=MemoryModel(KEY, (point(0.85), point(0.88))))
    core = Core.initial(learned)
    c = Ctx(now=1.0, cfg=cfg, rng=random.Random(0))
    core, _ = step(core, Boot(), c)
    _, actions = step(core, FleetAdvice(KEY, points=(point(0.85),)), c)
    (share,) = shares(actions)
    assert [p.fraction for p in share.points] == [0.85, 0.88]
    _, actions = step(core, FleetAdvice(KEY, points=(point(0.88), point(0.85))), c)
    assert shares(actions) == []  # it has them all: no write


def test_the_fleets_rung_never_undoes_a_climb_on_probation_nor_one_kept() -> None:
    """The fleet fell to 0.80 once (an OOM at 0.88). A server here climbs 0.85 -> 0.87:
    the fleet's rung must not send the climb's launch back to 0.80; once the climb is kept,
    0.87 is shared as kept and the next launch starts there, not at the rung."""
    cfg = fleet_cfg(climb=True)
    rung_only = FleetAdvice(KEY, 0.80, (0.88,), "h/s (c)", "T0")
    server = FleetServer(cfg, rung_only)
    server.core = replace(server.core, learned=replace(server.core.learned, fraction=0.85,
                                                       capacity=MemoryModel(KEY, (point(0.80), point(0.85)))))
    server.send(Boot())
    assert server.core.learned.fraction == 0.80  # the fleet's rung applies to a plain launch
    server.core = replace(server.core, learned=replace(server.core.learned, fraction=0.85))
    server.launch_to_ready()
    server.send(GpuFree((9.0, 8.0)))
    server.send(TimerFired(Timer.STABLE), after=600.0)
    server.send(KvPressure("retraction", "x"), after=1.0)
    assert server.send(ClimbAllowed(0.87))
    server.send(Died(ExitStatus(code=0)))
    server.send(Diagnosed(ExitStatus(code=0), None))
    server.send(TimerFired(Timer.BACKOFF), after=0.5)
    assert server.core.learned.fraction == 0.87 and server.core.climb_from == 0.85
    launched = [a for a in server.send(Prepared()) if isinstance(a, Launch)]
    assert launched and launched[0].fraction == 0.87
    server.send(Launched(4242))
    server.send(ProbeResult(ok=True), after=30.0)
    server.send(TimerFired(Timer.PROBATION), after=server.cfg.policy.probation_s)
    assert server.core.learned.capacity.kept == 0.87 and server.shared[-1].kept == 0.87
    # a later plain launch: the fleet's record says kept 0.87 (it was shared), the rung 0.80
    server.advice = replace(rung_only, kept=0.87)
    server.core = replace(server.core, state=State.BACKOFF)
    server.send(TimerFired(Timer.BACKOFF))
    assert server.core.learned.fraction == 0.87
    # the fleet ran out at 0.86 since: 0.87 is no longer kept, the rung applies again
    server.advice = FleetAdvice(KEY, 0.80, (0.88, 0.86), "h/s (c)", "T1", kept=None)
    server.core = replace(server.core, state=State.BACKOFF)
    server.send(TimerFired(Timer.BACKOFF))
    assert server.core.learned.fraction == 0.80


def test_a_climb_that_fails_tells_the_fleet_the_fraction_it_fell_back_to() -> None:
    """0.80 -> 0.87 spans a rung (0.85): the failed climb goes back to 0.80, and so does
    the lesson the fleet gets, not to the ladder's next rung below 0.87."""
    cfg = fleet_cfg(climb=True)
    server = FleetServer(cfg, FleetAdvice(KEY))
    server.core = replace(server.core, learned=replace(server.core.learned, fraction=0.80,
                                                       capacity=MemoryModel(KEY, (point(0.80), point(0.85)))))
    server.send(Boot())
    server.launch_to_ready()
    server.send(GpuFree((9.0, 8.0)))
    server.send(TimerFired(Timer.STABLE), after=600.0)
    (ask,) = [a for a in server.send(KvPressure("retraction", "x"), after=1.0) if isinstance(a, AskClimb)]
    assert ask.fraction > 0.85
    server.send(ClimbAllowed(ask.fraction))
    server.send(Died(ExitStatus(code=0)))
    server.send(Diagnosed(ExitStatus(code=0), None))
    server.launch_to_ready()
    server.died(Cause.CUDA_OOM_RUNTIME)  # on probation: back to 0.80 at once
    assert server.core.learned.fraction == 0.80
    (lesson,) = server.shared[-1].entries
    assert (lesson.fraction, lesson.next_fraction) == (ask.fraction, 0.80)


# --- two daemons' fleet services against a real etcd -----------------------------------------------

GPUS = [GpuInfo(0, "GPU-0", "NVIDIA H200", 150_754_820_096, 1, 1), GpuInfo(1, "GPU-1", "NVIDIA H200", 150_754_820_096, 1, 1)]


def test_two_daemons_share_their_points_and_a_kept_climb_through_a_real_etcd(etcd_server: EtcdServer) -> None:  # noqa: F811
    cfg = build_config({
        "server": {"model_path": "m", "tp_size": 2, "mem_fraction_static": 0.88},
        "gpu": {"backend": "nvml"}, "etcd": {"endpoints": [etcd_server.endpoint]}, "fleet": {"enabled": True},
    })

    async def go() -> None:
        clients = [EtcdClient([etcd_server.endpoint], timeout_s=5.0) for _ in range(2)]
        events: list[ev.Event] = []
        shared: list[Any] = []
        syncs = [FleetSync(c, lambda command, env: "0.5.23", prefix=FLEET_PREFIX, host=f"gpu-{i}",
                           emit=events.append, shared=shared.append, wall_now=lambda: "W", timeout_s=5.0,
                           environ={}, rng=random.Random(i)) for i, c in enumerate(clients)]
        tasks = [asyncio.create_task(s.run()) for s in syncs]
        try:
            a, b = [await s.advice(cfg, GPUS) for s in syncs]
            assert a.key == b.key and a.points == () and a.kept is None
            # both write at once: the compare-and-swap keeps both daemons' points
            syncs[0].share(FleetShare((), a.key, (point(0.80, {"TP0": 12.0, "TP1": 11.0}),)))
            syncs[1].share(FleetShare((), b.key, (point(0.85, {"TP1": 8.0}),), kept=0.85))
            for _ in range(500):
                if len([e for e in events if isinstance(e, ev.FleetUpdated)]) >= 2:
                    break
                await asyncio.sleep(0.01)
            again = await syncs[0].advice(cfg, GPUS)
            assert sorted(p.fraction for p in again.points) == [0.80, 0.85] and again.kept == 0.85
            # what daemon 0 then learns from it: two fractions and a serving peak, a recommendation
            model = MemoryModel().joined(again.key, again.points, again.kept)
            learned = replace(Learned.initial(cfg), capacity=model)
            rec = learned.recommendation(cfg)
            assert rec.fraction is not None, rec.missing
            # the same points again: nothing to write, nothing said
            before = len([e for e in events if isinstance(e, ev.FleetUpdated)])
            syncs[0].share(FleetShare((), again.key, again.points, 0.85))
            await asyncio.sleep(0.5)
            assert len([e for e in events if isinstance(e, ev.FleetUpdated)]) == before
            assert not [e for e in events if isinstance(e, ev.FleetError)]
        finally:
            for t in tasks:
                t.cancel()
            for c in clients:
                await c.aclose()

    asyncio.run(go())
