"""Fleet memory's pure parts (issue 16, item 2): the core applies the fleet's rung before a
launch (lowering only, never below the floor, noted in the learned state), queues its own
OOMs for the record until they are in, and the record merges without ever raising the rung.
Also the service over a fake store: compare-and-swap conflicts, an etcd that is away.
No event loop in the core tests, no sleeps, no processes.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from typing import Any

import pytest

from supervisor.adapters.ports import GpuInfo
from supervisor.aio import Backoff
from supervisor.core import events as ev
from supervisor.core.config import Config, ConfigError, build_config
from supervisor.core.fleet import FLEET_PREFIX, RECORD_OOMS, FleetOom, FleetRecord, merge
from supervisor.core.machine import step
from supervisor.core.messages import (
    Boot,
    Ctx,
    Diagnosed,
    Died,
    Emit,
    FleetAdvice,
    FleetShare,
    FleetShared,
    Launch,
    Persist,
    Prepared,
)
from supervisor.core.model import Cause, Diagnosis, ExitStatus, Phase, State
from supervisor.core.state import Core, Learned
from supervisor.services import fleet_sync
from supervisor.services.fleet_sync import FleetSync, gpu_identity

KEY = f"{FLEET_PREFIX}/moonshotai_Kimi-K2.5/0.5.23/Simulated_GPU_96GB-98304MiB/tp8-dp1-pp1-ep1-n1/abcdef012345"
NOW = 1000.0


def make_cfg(fleet: bool = True, **sections: dict[str, Any]) -> Config:
    data: dict[str, dict[str, Any]] = {
        "server": {"model_path": "moonshotai/Kimi-K2.5", "tp_size": 8, "mem_fraction_static": 0.93},
        "etcd": {"endpoints": ["127.0.0.1:2379"]},
        "fleet": {"enabled": fleet},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return build_config(data, name="kimi")


def ctx(cfg: Config, now: float = NOW) -> Ctx:
    return Ctx(now=now, cfg=cfg, rng=random.Random(0), wall_time="2026-01-02T03:04:05.000Z")


def preparing(cfg: Config, learned: Learned | None = None) -> Core:
    core, _ = step(Core.initial(learned or Learned.initial(cfg)), Boot(), ctx(cfg))
    assert core.state is State.PREPARING
    return core


def emitted(actions: list[Any], cls: type) -> list[Any]:
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, cls)]


def oom_crash(core: Core, cfg: Config) -> tuple[Core, list[Any]]:
    """The launched server dies of a runtime CUDA OOM while serving."""
    core, _ = step(core, Died(ExitStatus(code=None, signal=9)), ctx(cfg, NOW + 5))
    diagnosis = Diagnosis(cause=Cause.CUDA_OOM_RUNTIME, phase=Phase.SERVING, evidence=("torch.OutOfMemoryError",))
    return step(core, Diagnosed(ExitStatus(code=None, signal=9), diagnosis), ctx(cfg, NOW + 6))


# --- applying the fleet's rung ------------------------------------------------------------------


def test_fleet_advice_lowers_the_rung_before_the_launch_and_says_so() -> None:
    """The fleet reached 0.88 on this configuration: the first launch has 0.88, not 0.93."""
    cfg = make_cfg()
    core, actions = step(preparing(cfg), FleetAdvice(KEY, 0.88, (0.93,), "gpu-3/kimi (kimi)", "T1"), ctx(cfg))
    assert core.learned.fraction == 0.88
    assert Persist() in actions
    (applied,) = emitted(actions, ev.FleetApplied)
    assert (applied.key, applied.mem_fraction_static, applied.own_mem_fraction_static) == (KEY, 0.88, 0.93)
    assert applied.source == "gpu-3/kimi (kimi)" and applied.rung == 1
    note = core.learned.fleet
    assert note is not None and note.applied and note.own_fraction == 0.93 and note.applied_at
    core, actions = step(core, Prepared(), ctx(cfg))
    (launch,) = [a for a in actions if isinstance(a, Launch)]
    assert launch.fraction == 0.88 and "0.88" in launch.argv


def test_fleet_advice_never_raises_our_rung() -> None:
    """Our own ladder is at 0.85; the fleet's 0.88 is higher: nothing changes but the note."""
    cfg = make_cfg()
    learned = replace(Learned.initial(cfg), fraction=0.85)
    core, actions = step(preparing(cfg, learned), FleetAdvice(KEY, 0.88, (0.93,), "h/s (c)", "T"), ctx(cfg))
    assert core.learned.fraction == 0.85
    assert not emitted(actions, ev.FleetApplied)
    assert core.learned.fleet is not None and not core.learned.fleet.applied


def test_fleet_advice_never_goes_below_our_ladder_floor() -> None:
    """A fleet whose ladder went to 0.70 takes us only to our floor, 0.80."""
    cfg = make_cfg()
    core, actions = step(preparing(cfg), FleetAdvice(KEY, 0.70, (0.93, 0.75), "h/s (c)", "T"), ctx(cfg))
    assert core.learned.fraction == 0.80
    (applied,) = emitted(actions, ev.FleetApplied)
    assert applied.mem_fraction_static == 0.80 and applied.fleet_mem_fraction_static == 0.70


def test_fleet_advice_is_ignored_while_a_server_runs() -> None:
    """The fraction of a running server is its argv's: a late advice must not rewrite it."""
    cfg = make_cfg()
    core, _ = step(preparing(cfg), Prepared(), ctx(cfg))
    assert core.state is State.STARTING
    after, actions = step(core, FleetAdvice(KEY, 0.85), ctx(cfg))
    assert after == core and actions == []


def test_fleet_advice_without_a_record_or_key_changes_nothing() -> None:
    cfg = make_cfg()
    core = preparing(cfg)
    for advice in (FleetAdvice(KEY), FleetAdvice("", 0.85)):
        after, actions = step(core, advice, ctx(cfg))
        assert after.learned == core.learned and not emitted(actions, ev.FleetApplied)


def test_sglang_choosing_its_fraction_is_not_overridden_by_the_fleet() -> None:
    """No configured fraction (SGLang chooses): the fleet's rung is not forced on it."""
    cfg = build_config({"server": {"model_path": "m"}, "etcd": {"endpoints": ["e:1"]}, "fleet": {"enabled": True}})
    core, actions = step(preparing(cfg), FleetAdvice(KEY, 0.88), ctx(cfg))
    assert core.learned.fraction is None and not emitted(actions, ev.FleetApplied)


def test_the_applied_rung_and_note_survive_a_restart() -> None:
    """Persisted: state.json's learned state brings back the rung, the note and the unshared OOMs."""
    cfg = make_cfg()
    core, _ = step(preparing(cfg), FleetAdvice(KEY, 0.88, (0.93,), "h/s (c)", "T"), ctx(cfg))
    learned = replace(core.learned, fleet_pending=(FleetOom(0.88, 0.85, "T2", "cuda_oom_runtime", "kimi", "kimi", key=KEY),))
    again = Learned.from_dict(json.loads(json.dumps(learned.to_dict())))
    assert again == learned
    assert again.rebased(cfg) == again  # same configured start: kept as it is
    # A state file from before [fleet] still loads.
    old = {k: v for k, v in learned.to_dict().items() if k not in ("fleet", "fleet_pending")}
    assert Learned.from_dict(old).fleet is None


def test_the_fleets_ooms_are_a_ceiling_for_the_ladder() -> None:
    """The fleet ran out at 0.93: a KV pool too small at 0.88 does not climb back to 0.93."""
    cfg = make_cfg()
    core, _ = step(preparing(cfg), FleetAdvice(KEY, 0.88, (0.93,), "h/s (c)", "T"), ctx(cfg))
    core, _ = step(core, Prepared(), ctx(cfg))
    core, _ = step(core, Died(ExitStatus(code=1)), ctx(cfg, NOW + 1))
    kv = Diagnosis(cause=Cause.KV_POOL_TOO_SMALL, phase=Phase.STARTING, evidence=("Not enough memory",))
    core, _ = step(core, Diagnosed(ExitStatus(code=1), kv), ctx(cfg, NOW + 2))
    assert core.learned.fraction != 0.93


# --- sharing our OOMs ----------------------------------------------------------------------------


def test_a_runtime_oom_queues_the_lesson_for_the_fleet_until_it_is_in() -> None:
    """0.93 ran out, 0.88 is next: a FleetShare with where and when; FleetShared clears it."""
    cfg = make_cfg()
    core, _ = step(preparing(cfg), FleetAdvice(KEY), ctx(cfg))
    core, _ = step(core, Prepared(), ctx(cfg))
    core, actions = oom_crash(core, cfg)
    (share,) = [a for a in actions if isinstance(a, FleetShare)]
    (lesson,) = share.entries
    assert (lesson.fraction, lesson.next_fraction, lesson.cause) == (0.93, 0.88, "cuda_oom_runtime")
    assert (lesson.key, lesson.server, lesson.config, lesson.when) == (KEY, "kimi", "kimi", "2026-01-02T03:04:05.000Z")
    assert core.learned.fleet_pending == (lesson,) and core.learned.fraction == 0.88
    core, actions = step(core, FleetShared((lesson,)), ctx(cfg))
    assert core.learned.fleet_pending == () and actions == [Persist()]


def test_lessons_left_unshared_go_out_at_the_next_launch() -> None:
    """A daemon restarted while etcd was away: its next prepare writes what is pending."""
    cfg = make_cfg()
    lesson = FleetOom(0.93, 0.88, "T", "cuda_oom_runtime", "kimi", "kimi", key=KEY)
    learned = replace(Learned.initial(cfg), fraction=0.88, fleet_pending=(lesson,))
    _, actions = step(preparing(cfg, learned), FleetAdvice(KEY), ctx(cfg))
    assert FleetShare((lesson,)) in actions


def test_without_fleet_nothing_is_queued() -> None:
    cfg = make_cfg(fleet=False)
    core, _ = step(preparing(cfg), Prepared(), ctx(cfg))
    core, actions = oom_crash(core, cfg)
    assert core.learned.fleet_pending == () and not [a for a in actions if isinstance(a, FleetShare)]


# --- the record ----------------------------------------------------------------------------------


def test_merge_keeps_the_lowest_rung_and_each_oom_once() -> None:
    a = FleetOom(0.93, 0.88, "T1", "cuda_oom_runtime", "s", "c", host="h1")
    b = FleetOom(0.88, 0.85, "T2", "cuda_oom_runtime", "s", "c", host="h2")
    record = merge(None, KEY, [b], "U1")
    assert record.rung == 0.85
    record = merge(record, KEY, [a, b], "U2")  # b again (a retried write): once; a: rung stays 0.85
    assert record.rung == 0.85 and [o.fraction for o in record.ooms] == [0.88, 0.93]
    back = FleetRecord.from_json(KEY, record.to_json())
    assert back == record and back.lowest() == replace(b, key="") and back.oom_fractions == {0.93, 0.88}
    many = merge(None, KEY, [replace(a, when=f"T{i}") for i in range(RECORD_OOMS + 5)], "U")
    assert len(many.ooms) == RECORD_OOMS and many.rung == 0.88
    with pytest.raises(ValueError, match="not a fleet record"):
        FleetRecord.from_json(KEY, b"[1, 2")


def test_config_fleet_needs_etcd_endpoints() -> None:
    """One line naming the key that is missing."""
    with pytest.raises(ConfigError, match=r"\[etcd\] endpoints: missing: \[fleet\] enabled"):
        build_config({"server": {"model_path": "m"}, "fleet": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"\[fleet\] prefix"):
        build_config({"server": {"model_path": "m"}, "fleet": {"prefix": "no-slash"}})
    cfg = build_config({"server": {"model_path": "m"}})
    assert not cfg.fleet.enabled and cfg.fleet.prefix == FLEET_PREFIX


# --- the service over a fake store ---------------------------------------------------------------


class FakeKv:
    def __init__(self) -> None:
        self.data: dict[str, tuple[bytes, int]] = {}
        self.revision = 0
        self.fail: Exception | None = None
        self.interleave: list[bytes] = []  # written by "another daemon" just before our CAS

    async def get(self, key: str) -> Any:
        if self.fail:
            raise self.fail
        if key not in self.data:
            return None
        value, rev = self.data[key]
        return type("KV", (), {"value": value, "mod_revision": rev})()

    async def put_if(self, key: str, value: bytes, mod_revision: int) -> int | None:
        if self.fail:
            raise self.fail
        if self.interleave:
            self.revision += 1
            self.data[key] = (self.interleave.pop(0), self.revision)
        current = self.data.get(key, (b"", 0))[1]
        if current != mod_revision:
            return None
        self.revision += 1
        self.data[key] = (value, self.revision)
        return self.revision


def sync(store: FakeKv, events: list[ev.Event], shared: list[Any], *, version: str = "0.5.23") -> FleetSync:
    return FleetSync(store, lambda command, env: version, prefix=FLEET_PREFIX, host="gpu-7", emit=events.append,
                     shared=shared.append, wall_now=lambda: "W", timeout_s=2.0, environ={}, rng=random.Random(0))


GPUS = [GpuInfo(0, "GPU-0", "NVIDIA H200", 150_000_000_000, 1, 1), GpuInfo(1, "GPU-1", "NVIDIA H200", 150_000_000_000, 1, 1)]


def test_a_write_that_loses_the_race_is_merged_again_and_keeps_both() -> None:
    """Another daemon wrote between our read and our compare-and-swap: read, merge, again."""
    cfg = make_cfg(gpu={"backend": "nvml"})
    store, events, shared = FakeKv(), [], []

    async def go() -> None:
        s = sync(store, events, shared)
        advice = await s.advice(cfg, GPUS)
        assert advice.fraction is None and advice.key.startswith(FLEET_PREFIX + "/moonshotai_Kimi-K2.5/0.5.23/NVIDIA_H200-")
        theirs = FleetOom(0.85, 0.82, "T0", "cuda_oom_runtime", "b", "b", host="gpu-9")
        store.interleave = [merge(None, advice.key, [theirs], "W0").to_json()]
        ours = FleetOom(0.93, 0.88, "T1", "cuda_oom_runtime", "kimi", "kimi", key=advice.key)
        task = asyncio.create_task(s.run())
        s.share(FleetShare((ours,)))
        for _ in range(100):
            if shared:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert shared == [(ours,)]
        record = FleetRecord.from_json(advice.key, store.data[advice.key][0])
        assert record.rung == 0.82 and {o.host for o in record.ooms} == {"gpu-9", "gpu-7"}
        (updated,) = [e for e in events if isinstance(e, ev.FleetUpdated)]
        assert updated.conflicts == 1
        again = await s.advice(cfg, GPUS)
        assert again.fraction == 0.82 and again.source == "gpu-9/b (b)"

    asyncio.run(go())


def test_etcd_away_is_an_error_and_a_retry_never_an_exception() -> None:
    """Reads give no advice, writes are retried on a backoff until etcd answers."""
    cfg = make_cfg(gpu={"backend": "nvml"})
    store, events, shared = FakeKv(), [], []
    store.fail = ConnectionError("etcd http://127.0.0.1:1: connection refused")

    async def go() -> None:
        s = sync(store, events, shared)
        advice = await s.advice(cfg, GPUS)
        assert advice.fraction is None and advice.key
        task = asyncio.create_task(s.run())
        s.share(FleetShare((FleetOom(0.93, 0.88, "T1", "cuda_oom_runtime", "kimi", "kimi", key=advice.key),)))
        for _ in range(100):
            if any(isinstance(e, ev.FleetError) and e.op == "write" for e in events):
                break
            await asyncio.sleep(0.01)
        store.fail = None
        for _ in range(300):
            if shared:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        errors = [e for e in events if isinstance(e, ev.FleetError)]
        assert errors[0].op == "read" and "connection refused" in errors[0].error
        assert errors[1].op == "write" and errors[1].retry_s and errors[1].pending == 1
        assert shared and store.data[advice.key]

    asyncio.run(go())


def test_gpu_identity_from_the_probe_and_unknown_without_one() -> None:
    assert gpu_identity(make_cfg(gpu={"backend": "nvml"}), GPUS) == ("NVIDIA H200", 150_000_000_000)
    assert gpu_identity(make_cfg(), []) == ("unknown", 0)  # backend "none"


def test_an_unreadable_version_means_no_fleet_for_that_launch() -> None:
    """Never a key of 'unknown' versions shared by different releases: an error, no advice."""
    cfg = make_cfg()
    events: list[ev.Event] = []

    def no_version(command: Any, env: Any) -> str:
        raise RuntimeError("sglang is not installed for python")

    s = FleetSync(FakeKv(), no_version, prefix=FLEET_PREFIX, host="h", emit=events.append, shared=print,
                  wall_now=lambda: "W", timeout_s=1.0, environ={})
    advice = asyncio.run(s.advice(cfg, []))
    assert advice == FleetAdvice("")
    (error,) = events
    assert isinstance(error, ev.FleetError) and error.op == "version" and "not installed" in error.error


def test_lessons_without_a_key_wait_for_the_next_launch_quietly() -> None:
    """The identity could not be read (its own fleet_error said so): no retry storm; the next
    launch that reads a key writes them under it."""
    store, events, shared = FakeKv(), [], []
    cfg = make_cfg(gpu={"backend": "nvml"})

    async def go() -> None:
        s = sync(store, events, shared)
        task = asyncio.create_task(s.run())
        lesson = FleetOom(0.93, 0.88, "T1", "cuda_oom_runtime", "kimi", "kimi")  # key unknown at the crash
        s.share(FleetShare((lesson,)))
        await asyncio.sleep(0.1)
        assert events == [] and shared == [] and store.data == {}
        advice = await s.advice(cfg, GPUS)  # the next launch
        s.share(FleetShare((lesson,)))
        for _ in range(100):
            if shared:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert shared == [(lesson,)] and advice.key in store.data

    asyncio.run(go())


def test_an_etcd_outage_is_one_link_down_and_one_link_up_for_the_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read that finds etcd away begins the outage (one link_down); the write retries
    that follow are fleet_errors, each waiting a longer step, and no more link_downs; the
    write that goes through ends it (one link_up)."""
    monkeypatch.setattr(fleet_sync, "RETRY", Backoff(initial=0.001, maximum=0.016, jitter=(1.0, 1.0)))
    cfg = make_cfg(gpu={"backend": "nvml"})
    store, events, shared = FakeKv(), [], []
    store.fail = ConnectionError("etcd http://127.0.0.1:1: connection refused")

    async def go() -> None:
        s = sync(store, events, shared)
        advice = await s.advice(cfg, GPUS)
        task = asyncio.create_task(s.run())
        s.share(FleetShare((FleetOom(0.93, 0.88, "T1", "cuda_oom_runtime", "kimi", "kimi", key=advice.key),)))
        async with asyncio.timeout(30):
            while sum(isinstance(e, ev.FleetError) and e.op == "write" for e in events) < 4:
                await asyncio.sleep(0.001)
            store.fail = None
            while not shared:
                await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    links = [e for e in events if isinstance(e, ev.LinkDown | ev.LinkUp)]
    assert [(type(e).__name__, e.link) for e in links] == [("LinkDown", "fleet"), ("LinkUp", "fleet")]
    assert "connection refused" in links[0].error
    waits = [e.retry_s for e in events if isinstance(e, ev.FleetError) and e.op == "write"]
    assert waits[:4] == [0.002, 0.004, 0.008, 0.016]  # the read was the outage's first try
