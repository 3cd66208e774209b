"""What launches teach and what they ask for: the memory model (``core.capacity``), the
recommended fraction, KV pressure and the climb, the fleet's advice, and the headroom guard."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import replace
from operator import attrgetter

from supervisor.core import capacity, policy
from supervisor.core import events as ev
from supervisor.core.argv import build_argv
from supervisor.core.config import in_window
from supervisor.core.machine.edges import Step, Variant
from supervisor.core.machine.jobs import relaunch
from supervisor.core.messages import Action, AskClimb, Ctx, Emit, FleetAdvice, FleetShare, Persist
from supervisor.core.model import Cause, JobKind, StartupFacts, State
from supervisor.core.state import Core, FleetNote


def _capacity_key(core: Core, ctx: Ctx) -> str:
    """The memory model's key: the fleet's (model, SGLang version, GPU, layout, memory flags)
    when known, else this configuration's launch flags without the fraction (a model that
    then mispredicts a launch starts afresh: ``MemoryModel.launched``)."""
    if core.fleet_key:
        return core.fleet_key
    argv = build_argv(ctx.cfg, None, core.learned.hicache_size_gb)
    return "local:" + hashlib.sha256("\0".join(argv).encode()).hexdigest()[:16]


def recommended(core: Core, ctx: Ctx) -> ev.Recommended:
    rec = core.learned.recommendation(ctx.cfg)
    return ev.Recommended(
        fraction=rec.fraction, mem_fraction_static=rec.current, kv_tokens_now=rec.kv_tokens_now,
        kv_tokens_at=rec.kv_tokens_at, headroom_gb=rec.headroom_gb, rank=rec.rank, missing=rec.missing,
        words=rec.words(), points=len(core.learned.capacity.points),
    )


def with_model(core: Core, ctx: Ctx, model: capacity.MemoryModel, *, tell_fleet: bool = True) -> Step:
    """The model changed: kept, shared with the fleet, and the recommendation told when it
    changed."""
    if model == core.learned.capacity:
        return core, []
    new = replace(core, learned=replace(core.learned, capacity=model))
    out: list[Action] = [Persist(), *(share(new, ctx) if tell_fleet else [])]
    before, after = recommended(core, ctx), recommended(new, ctx)
    if replace(before, points=0) == replace(after, points=0):
        return new, out
    return replace(new, run=replace(new.run, recommendation_told=True)), [*out, Emit(after)]


def share(core: Core, ctx: Ctx) -> list[Action]:
    """[FleetShare] of what the fleet's record should hold of us (each one carries all of
    it: the lessons not yet in, and the memory model of the launch's key); [] without
    ``[fleet]`` or with nothing to share."""
    if not ctx.cfg.fleet.enabled:
        return []
    model = core.learned.capacity
    ours = bool(core.fleet_key) and model.key == core.fleet_key and bool(model.points or model.kept is not None)
    if not ours and not core.learned.fleet_pending:
        return []
    if not ours:
        return [FleetShare(core.learned.fleet_pending)]
    return [FleetShare(core.learned.fleet_pending, model.key, model.points, model.kept)]


def _record_lacks(model: capacity.MemoryModel, advice: FleetAdvice) -> bool:
    """The fleet's record lacks what this model knows (a point, a higher peak, a kept climb)."""
    if model.key != advice.key:
        return False
    by_fraction = attrgetter("fraction")
    if sorted(capacity.merge_points(advice.points, model.points), key=by_fraction) != sorted(advice.points, key=by_fraction):
        return True
    kept = model.kept
    return (kept is not None and not any(c <= kept + 1e-9 for c in advice.oom_fractions)
            and (advice.kept is None or advice.kept < kept - 1e-9))


def learn_launch(core: Core, ctx: Ctx, facts: StartupFacts) -> Step:
    """A launch's start-up facts, once its CUDA graphs are captured on every rank it names."""
    fraction = core.learned.fraction if core.learned.fraction is not None else facts.mem_fraction_static
    if fraction is None or not capacity.left_after_start(facts):
        return core, []
    return with_model(core, ctx, core.learned.capacity.launched(_capacity_key(core, ctx), fraction, facts))


def kv_pressure(core: Core, ctx: Ctx, source: str, detail: str) -> Step:
    """A sign that a higher fraction would pay: counted, told at most once per
    ``kv_pressure_every_s`` (with the signals in between), and a climb considered."""
    core = replace(core, kv_pressure_at=ctx.now, kv_signals=core.kv_signals + 1)
    out: list[Action] = []
    if core.kv_told_at is None or ctx.now - core.kv_told_at >= ctx.cfg.policy.kv_pressure_every_s:
        out.append(Emit(ev.KvPressureSeen(source=source, detail=detail[:300], signals=core.kv_signals,
                                          mem_fraction_static=core.learned.fraction)))
        core = replace(core, kv_signals=0, kv_told_at=ctx.now)
    return core, [*out, *climb_wanted(core, ctx)]


def climb_wanted(core: Core, ctx: Ctx) -> list[Action]:
    """[AskClimb(f*)] when a climb would pay and is allowed now (docs/capacity.md): climbing
    is on; READY for ``stable_after_s`` with KV pressure seen since; f* above the fraction;
    no climb in ``climb_interval_s`` and none on probation; a server alone only in its window."""
    cfg = ctx.cfg
    p = cfg.policy
    if not p.climb or core.state is not State.READY or core.run.ready_at is None or core.climb_from is not None:
        return []
    if ctx.now - core.run.ready_at < p.stable_after_s or core.failures:
        return []
    if core.kv_pressure_at is None or core.kv_pressure_at < core.run.ready_at:
        return []
    if core.climb_at is not None and ctx.now - core.climb_at < p.climb_interval_s:
        return []
    if not cfg.router.enabled and (ctx.local_minute is None or not in_window(p.climb_window, ctx.local_minute)):
        return []
    rec = core.learned.recommendation(ctx.cfg)
    if rec.fraction is not None:
        return [AskClimb(rec.fraction)] if rec.higher() else []
    # The model cannot say yet (one fraction known, or no serving peak): one step up, on
    # probation like any climb, which also gives the model its second point.
    current = core.learned.fraction
    if current is None:
        return []
    up = round(current + p.climb_step, 6)
    ceiling = p.climb_ceiling or p.fraction_ladder[0]
    if up > ceiling + 1e-9 or any(up >= c - 1e-9 for c in core.learned.ceiling_fractions):
        return []
    return [AskClimb(up)]


def fleet_advice(core: Core, advice: FleetAdvice, ctx: Ctx) -> Step:
    """The fleet's record, read before a launch. Its memory-model points join ours (and ours
    go out when it lacks them, with the lessons not yet in it). Its rung replaces ours only
    when lower: never below our ladder's floor, never raising ours, never below a fraction
    a climb kept past its probation (here or in the fleet) while nothing at or below that
    ran out, and never undoing a climb on probation unless the fleet ran out at or below it
    (then back to the last stable fraction)."""
    core = replace(core, fleet_key=advice.key)
    out: list[Action] = []
    if advice.key and ctx.cfg.fleet.enabled:
        if advice.points or advice.kept is not None:
            joined = core.learned.capacity.joined(advice.key, advice.points, advice.kept)
            core, out = with_model(core, ctx, joined, tell_fleet=False)
        if core.learned.fleet_pending or _record_lacks(core.learned.capacity, advice):
            out += share(core, ctx)
    learned = core.learned
    own = learned.fraction
    if advice.fraction is None or not advice.key:
        return core, out
    rung = max(advice.fraction, ctx.cfg.policy.fraction_ladder[-1])
    target = rung
    ran_out = (*learned.oom_fractions, *advice.oom_fractions)
    kept = learned.capacity.kept
    if kept is not None and not any(c <= kept + 1e-9 for c in ran_out):
        target = max(target, kept)
    if core.climb_from is not None and own is not None:
        if not any(c <= own + 1e-9 for c in advice.oom_fractions):
            target = max(target, own)  # the climb on probation stands
        else:
            target = min(target, core.climb_from)  # the fleet ran out there: back to the last stable one
            core = replace(core, climb_from=None)
    known = FleetNote(
        key=advice.key, fraction=rung, source=advice.source, when=advice.when,
        oom_fractions=tuple(sorted(advice.oom_fractions, reverse=True)), own_fraction=own,
    )
    if own is None or target >= own - 1e-9:
        # Not lower (or SGLang chooses ours): nothing applied. A note of an earlier
        # application of this same rung is kept, so status still says where ours came from.
        old = learned.fleet
        if old is not None and old.applied and (old.key, old.fraction) == (advice.key, rung):
            known = replace(old, oom_fractions=known.oom_fractions, source=advice.source, when=advice.when)
        if known == learned.fleet:
            return core, out
        return replace(core, learned=replace(learned, fleet=known)), [*out, Persist()]
    # our rung -> the fleet's (lower): the next launch starts there
    note = replace(known, applied=True, applied_at=ctx.wall_time)
    core = replace(core, learned=replace(learned, fraction=target, fleet=note))
    applied = ev.FleetApplied(
        key=advice.key, mem_fraction_static=target, fleet_mem_fraction_static=advice.fraction,
        own_mem_fraction_static=own, source=advice.source, when=advice.when,
        rung=policy.rung_of(target, ctx.cfg.policy.fraction_ladder),
    )
    return core, [*out, Persist(), Emit(applied)]


def facts_event(facts: StartupFacts) -> ev.StartupFactsEvent:
    return ev.StartupFactsEvent(
        ranks={k: dataclasses.asdict(v) for k, v in facts.ranks.items()},
        avail_mem_after_capture_gb=facts.avail_mem_after_capture_gb,
        max_total_num_tokens=facts.max_total_num_tokens,
        kv_cache_tokens=facts.kv_cache_tokens,
        progress=facts.progress,
    )



def check_headroom(core: Core, ctx: Ctx, v: Variant, facts: StartupFacts) -> Step:
    """The headroom guard: too little memory left after CUDA-graph capture."""
    avail = facts.avail_mem_after_capture_gb
    gpu = ctx.cfg.gpu
    if core.run.headroom_checked or avail is None or avail >= gpu.headroom_min_gb:
        return core, []
    if core.learned.fraction is None:  # SGLang's choice, and its log did not say it yet
        return core, []
    rank = min(
        (r for r in facts.ranks.values() if r.avail_mem_after_capture_gb is not None),
        key=lambda r: r.avail_mem_after_capture_gb or 0.0,
    ).rank
    lower = policy.fraction_below(core.learned.fraction, ctx.cfg.policy.fraction_ladder)
    step_down = gpu.headroom_action == "step_down" and lower is not None
    core = replace(core, run=replace(core.run, headroom_checked=True))
    alert = Emit(ev.HeadroomLow(
        avail_mem_gb=avail,
        threshold_gb=gpu.headroom_min_gb,
        rank=rank,
        action="step_down" if step_down else "warn",
        mem_fraction_static=core.learned.fraction,
        next_mem_fraction_static=lower if step_down else None,
    ))
    if not step_down:
        return core, [alert]
    detail = (
        f"{avail:g} GB left after CUDA-graph capture on {rank} < {gpu.headroom_min_gb:g} GB"
    )
    new, actions = relaunch(core, ctx, v, JobKind.STEP_DOWN, Cause.HEADROOM_LOW, detail, ctx.cfg.server.stop_grace_s)
    return new, [alert, *actions]


