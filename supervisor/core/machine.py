"""The supervisor's state machine: ``step(core, event, ctx) -> (core, actions)``.

Pure: no clock (``ctx.now`` is monotonic seconds handed in), no I/O, no asyncio. The
daemon feeds events and carries out the actions. Every edge is named in a comment
``# FROM -> TO`` and has a test named after it in tests/test_machine.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import replace
from operator import attrgetter
from typing import Any

from supervisor.core import capacity, policy
from supervisor.core import events as ev
from supervisor.core.argv import build_argv
from supervisor.core.capacity import rank_gpus
from supervisor.core.config import in_window, unit_name
from supervisor.core.fleet import FleetOom
from supervisor.core.group import GROUP_STOP
from supervisor.core.messages import (
    Action,
    AskClimb,
    Boot,
    CancelTimer,
    ClimbAllowed,
    ConfigChanged,
    Ctx,
    Diagnose,
    Diagnosed,
    Died,
    Emit,
    Event,
    Exit,
    FactsUpdated,
    Finding,
    FleetAdvice,
    FleetShare,
    FleetShared,
    GpuFree,
    GpuLost,
    GroupEnded,
    GroupGaveUp,
    GroupLaunch,
    GroupReport,
    KvPressure,
    KvSample,
    Launch,
    Launched,
    LaunchFailed,
    Persist,
    Prepare,
    Prepared,
    PrepareFailed,
    Probe,
    ProbeResult,
    RestartRequested,
    RouterAdd,
    RouterRemove,
    SetTimer,
    StopMode,
    StopRequested,
    StopServer,
    TimerFired,
)
from supervisor.core.model import Cause, Diagnosis, ExitStatus, Phase, Remedy, StartupFacts, State
from supervisor.core.state import (
    FLEET_PENDING_LIMIT,
    HISTORY_LIMIT,
    Core,
    CrashRecord,
    FleetNote,
    Timer,
)

# --- the transition function --------------------------------------------------------------


def _transition(core: Core, to: State, reason: str, **changes: Any) -> tuple[Core, list[Action]]:
    """The one place that changes ``state``. It persists, then emits ``state_changed``: a state
    is on disk before anyone is told of it, so a daemon killed right after the announcement
    still leaves that state for the next one."""
    new = replace(core, state=to, reason=reason, **changes)
    if to is core.state:
        return new, [Persist()]
    changed = ev.StateChanged(
        from_=core.state,
        to=to,
        reason=reason,
        mem_fraction_static=new.learned.fraction,
        hicache_size_gb=new.learned.hicache_size_gb,
        restarts=new.learned.restarts,
        last_cause=new.last_cause,
    )
    return new, [Persist(), Emit(changed)]


def _launch(core: Core, ctx: Ctx, reason: str) -> tuple[Core, list[Action]]:
    # PREPARING -> STARTING
    attempt = core.attempt + 1
    fraction, hicache = core.learned.fraction, core.learned.hicache_size_gb
    argv = build_argv(ctx.cfg, fraction, hicache)
    new, actions = _transition(
        core,
        State.STARTING,
        reason,
        attempt=attempt,
        pid=None,
        launched_at=ctx.now,
        ready_at=None,
        probe_failures=0,
        pending=None,
        pending_detail="",
        headroom_checked=False,
        facts=None,
        part_died="",
        recommendation_told=False,
    )
    return new, [
        Launch(argv, fraction, hicache, attempt, policy.rung_of(fraction, ctx.cfg.policy.fraction_ladder)),
        *actions,
        SetTimer(Timer.STARTUP, ctx.cfg.health.startup_timeout_s),
        SetTimer(Timer.SILENCE, min(ctx.cfg.health.startup_silence_s, ctx.cfg.health.startup_timeout_s)),
        SetTimer(Timer.PROBE, ctx.cfg.health.startup_poll_s),
    ]


def _cancel_run_timers() -> list[Action]:
    return [CancelTimer(t) for t in (Timer.PROBE, Timer.STARTUP, Timer.SILENCE, Timer.STABLE, Timer.PROBATION)]


def _prepare(core: Core, reason: str) -> tuple[Core, list[Action]]:
    # STOPPED/BACKOFF -> PREPARING
    new, actions = _transition(core, State.PREPARING, reason)
    return new, [*actions, Prepare()]


def _give_up(core: Core, reason: str, cause: Cause | None) -> tuple[Core, list[Action]]:
    # * -> GAVE_UP
    new, actions = _transition(core, State.GAVE_UP, reason, pid=None)
    return new, [
        *_cancel_run_timers(),
        *actions,
        Emit(ev.GaveUp(reason=reason, cause=cause, mem_fraction_static=new.learned.fraction,
                       restarts=new.learned.restarts, crashes=new.failures)),
    ]


def _crash_record(core: Core, ctx: Ctx, diagnosis: Diagnosis, exit_text: str,
                  next_fraction: float | None) -> CrashRecord:
    """The crash as the state file's history keeps it (``core``: as the server died)."""
    return CrashRecord(
        wall_time=ctx.wall_time,
        cause=diagnosis.cause,
        remedy=diagnosis.remedy,
        phase=diagnosis.phase,
        exit=exit_text,
        fraction=core.learned.fraction,
        next_fraction=next_fraction,
        evidence=(diagnosis.evidence[0] if diagnosis.evidence else "")[:300],
        location=diagnosis.location,
        attempt=core.attempt,
    )


def _crash_event(
    core: Core,
    diagnosis: Diagnosis,
    status: ExitStatus | None,
    *,
    next_fraction: float | None,
    next_hicache_size_gb: float | None,
    next_retry_s: float | None,
    failures: int,
    log_diagnosis: Diagnosis | None = None,
) -> ev.Crash:
    """The crash event (``core``: as the server died; the ``next_*`` are the policy's answer)."""
    return ev.Crash(
        cause=diagnosis.cause,
        remedy=diagnosis.remedy,
        phase=diagnosis.phase,
        exit_code=status.code if status else None,
        signal=status.signal if status else None,
        evidence=tuple(diagnosis.evidence),
        evidence_lineno=diagnosis.evidence_lineno,
        location=diagnosis.location,
        rank=diagnosis.rank,
        exc_type=diagnosis.exc_type,
        exc_message=diagnosis.exc_message,
        mem_fraction_static=core.learned.fraction,
        hicache_size_gb=core.learned.hicache_size_gb,
        attempt=core.attempt,
        next_mem_fraction_static=next_fraction,
        next_hicache_size_gb=next_hicache_size_gb,
        next_retry_s=next_retry_s,
        consecutive_failures=failures,
        certain=diagnosis.certain,
        phase_source=diagnosis.phase_source,
        runner_up=diagnosis.runner_up,
        min_fraction=diagnosis.min_fraction,
        part_died=core.part_died or None,
        # On a hang or a restart we asked for, what the server's own log said is kept.
        log_cause=None if log_diagnosis is None else log_diagnosis.cause,
        log_evidence=() if log_diagnosis is None else tuple(log_diagnosis.evidence),
        basis=diagnosis.basis,
        unrecognised=diagnosis.unrecognised,
        killed=diagnosis.killed,
    )


def _after_failure(
    core: Core,
    ctx: Ctx,
    *,
    diagnosis: Diagnosis,
    status: ExitStatus | None,
    immediate: bool = False,
    log_diagnosis: Diagnosis | None = None,
) -> tuple[Core, list[Action]]:
    """Record a crash, ask the policy, go to BACKOFF or GAVE_UP."""
    cfg = ctx.cfg
    cause = diagnosis.cause
    window_start = ctx.now - cfg.policy.crash_window_s
    counted = not immediate  # a preemptive step-down is not a crash
    before = core.learned.fraction
    crash_times = tuple(t for t in core.crash_times if t >= window_start)
    if counted:
        crash_times += (ctx.now,)
    failures = core.failures + 1 if counted else core.failures
    learned = core.learned
    decision = policy.decide(
        cause=cause,
        remedy=diagnosis.remedy,
        fraction=learned.fraction,
        hicache_size_gb=learned.hicache_size_gb,
        oom_fractions=learned.ceiling_fractions,
        crashes_in_window=len(crash_times),
        failures=failures,
        cfg=cfg.policy,
        jitter_sample=ctx.rng.random(),
        immediate=immediate,
        min_fraction=diagnosis.min_fraction,
    )
    fell_back: list[Action] = []
    if cause is Cause.CLIMB and core.climb_to is not None and not decision.give_up:
        # the climb: relaunched at once at the higher fraction, on probation from the last stable one
        decision = replace(decision, fraction=core.climb_to,
                           reason=f"{cause.summary}: mem_fraction_static {before:g} -> {core.climb_to:g}")
        core = replace(core, climb_to=None, climb_from=before)
    elif (core.climb_from is not None and core.climb_at is not None and diagnosis.remedy is Remedy.FRACTION_DOWN
          and ctx.now - core.climb_at <= cfg.policy.probation_s and not decision.give_up):
        # the higher fraction failed on probation: back to the last stable one at once; the
        # failed one is a ceiling from now on (oom_fractions, shared with the fleet)
        decision = replace(decision, fraction=core.climb_from, delay_s=0.0,
                           reason=f"{cause.summary} on probation: mem_fraction_static {before:g} -> "
                                  f"{core.climb_from:g} (the last stable one)")
        fell_back = [Emit(ev.ClimbFellBack(mem_fraction_failed=before, mem_fraction_static=core.climb_from,
                                           cause=cause))]
        core = replace(core, climb_from=None)
    next_fraction = None if decision.give_up else decision.fraction
    oom = learned.oom_fractions
    pending = learned.fleet_pending
    ran_out = learned.fraction if diagnosis.remedy is Remedy.FRACTION_DOWN else None
    if ran_out is not None:
        oom = oom | {ran_out}
        if cfg.fleet.enabled:
            # The fleet learns what our ladder learned: the fraction that ran out and the
            # fraction it led to (after a failed climb, the last stable one).
            lesson = FleetOom(
                fraction=ran_out, next_fraction=next_fraction,
                when=ctx.wall_time, cause=str(cause), server=unit_name(cfg), config=cfg.name, key=core.fleet_key,
            )
            pending = (*pending, lesson)[-FLEET_PENDING_LIMIT:]
    record = _crash_record(core, ctx, diagnosis, status.describe() if status else "stopped by the supervisor",
                           next_fraction)
    crash_event = Emit(_crash_event(
        core, diagnosis, status, next_fraction=next_fraction,
        next_hicache_size_gb=None if decision.give_up else decision.hicache_size_gb,
        next_retry_s=None if decision.give_up else round(decision.delay_s, 3), failures=failures,
        log_diagnosis=log_diagnosis,
    ))
    learned = replace(
        learned,
        oom_fractions=oom,
        history=(*learned.history, record)[-HISTORY_LIMIT:],
        fraction=decision.fraction,
        hicache_size_gb=decision.hicache_size_gb,
        restarts=learned.restarts + (0 if decision.give_up else 1),
        fleet_pending=pending,
    )
    core = replace(
        core,
        learned=learned,
        crash_times=crash_times,
        failures=failures,
        last_cause=cause,
        recovering_from=cause,
        pid=None,
    )
    share = _share(core, ctx) if ran_out is not None else []
    crash_events: list[Action] = [*([crash_event] if counted else []), *share, *fell_back]
    if decision.give_up:
        new, actions = _give_up(core, decision.reason, cause)
        return new, [*crash_events, *actions]
    # STARTING/READY/RESTARTING -> BACKOFF
    new, actions = _transition(core, State.BACKOFF, decision.reason)
    return new, [
        *crash_events,
        *_cancel_run_timers(),
        *actions,
        Emit(ev.RestartScheduled(
            delay_s=round(decision.delay_s, 3),
            cause=cause,
            mem_fraction_static=decision.fraction,
            hicache_size_gb=decision.hicache_size_gb,
            attempt=core.attempt + 1,
            rung=policy.rung_of(decision.fraction, cfg.policy.fraction_ladder),
            mem_fraction_before=before,
        )),
        SetTimer(Timer.BACKOFF, decision.delay_s),
    ]


def _stop_to_relaunch(
    core: Core, ctx: Ctx, cause: Cause, detail: str, grace_s: float, mode: StopMode = StopMode.DRAIN
) -> tuple[Core, list[Action]]:
    # STARTING/READY -> RESTARTING
    new, actions = _transition(
        core, State.RESTARTING, f"{cause.summary}: {detail}", pending=cause, pending_detail=detail
    )
    return new, [
        *_cancel_run_timers(),
        *actions,
        StopServer(grace_s, str(cause), mode),
    ]


def _check_headroom(core: Core, ctx: Ctx, facts: StartupFacts) -> tuple[Core, list[Action]]:
    """The headroom guard: too little memory left after CUDA-graph capture."""
    avail = facts.avail_mem_after_capture_gb
    gpu = ctx.cfg.gpu
    if core.headroom_checked or avail is None or avail >= gpu.headroom_min_gb:
        return core, []
    if core.learned.fraction is None:  # SGLang's choice, and its log did not say it yet
        return core, []
    rank = min(
        (r for r in facts.ranks.values() if r.avail_mem_after_capture_gb is not None),
        key=lambda r: r.avail_mem_after_capture_gb or 0.0,
    ).rank
    lower = policy.fraction_below(core.learned.fraction, ctx.cfg.policy.fraction_ladder)
    step_down = gpu.headroom_action == "step_down" and lower is not None
    core = replace(core, headroom_checked=True)
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
    new, actions = _stop_to_relaunch(
        core, ctx, Cause.HEADROOM_LOW, detail, ctx.cfg.server.stop_grace_s
    )
    return new, [alert, *actions]


def _ready(core: Core, ctx: Ctx) -> tuple[Core, list[Action]]:
    # STARTING -> READY
    startup_s = ctx.now - (ctx.now if core.launched_at is None else core.launched_at)
    new, actions = _transition(
        core, State.READY, "health probe answered 200", ready_at=ctx.now, probe_failures=0,
        recovering_from=None, kv_queue=None,
    )
    ready = ev.ServerReady(
        startup_s=round(startup_s, 3),
        mem_fraction_static=core.learned.fraction,
        hicache_size_gb=core.learned.hicache_size_gb,
        attempt=core.attempt,
    )
    out: list[Action] = [CancelTimer(Timer.STARTUP), *actions, Emit(ready)]
    if core.facts is not None:
        out.append(Emit(facts_event(core.facts)))
    if core.recovering_from:
        out.append(Emit(ev.Recovered(
            startup_s=ready.startup_s, mem_fraction_static=ready.mem_fraction_static,
            hicache_size_gb=ready.hicache_size_gb, attempt=ready.attempt, cause=core.recovering_from,
            mem_fraction_before=core.learned.history[-1].fraction if core.learned.history else None,
        )))
    out += [
        SetTimer(Timer.PROBE, ctx.cfg.health.interval_s),
        SetTimer(Timer.STABLE, ctx.cfg.policy.stable_after_s),
    ]
    if not new.recommendation_told:  # once per launch at least (the metrics after a daemon restart)
        out.append(Emit(_recommended(new, ctx)))
        new = replace(new, recommendation_told=True)
    if new.climb_from is not None and new.climb_at is not None:
        out.append(SetTimer(Timer.PROBATION, max(0.0, ctx.cfg.policy.probation_s - (ctx.now - new.climb_at))))
    return new, out


# --- capacity: the memory model, the recommended fraction, the climb (core.capacity) --------


def _capacity_key(core: Core, ctx: Ctx) -> str:
    """The memory model's key: the fleet's (model, SGLang version, GPU, layout, memory flags)
    when known, else this configuration's launch flags without the fraction (a model that
    then mispredicts a launch starts afresh: ``MemoryModel.launched``)."""
    if core.fleet_key:
        return core.fleet_key
    argv = build_argv(ctx.cfg, None, core.learned.hicache_size_gb)
    return "local:" + hashlib.sha256("\0".join(argv).encode()).hexdigest()[:16]


def _recommended(core: Core, ctx: Ctx) -> ev.Recommended:
    rec = core.learned.recommendation(ctx.cfg)
    return ev.Recommended(
        fraction=rec.fraction, mem_fraction_static=rec.current, kv_tokens_now=rec.kv_tokens_now,
        kv_tokens_at=rec.kv_tokens_at, headroom_gb=rec.headroom_gb, rank=rec.rank, missing=rec.missing,
        words=rec.words(), points=len(core.learned.capacity.points),
    )


def _with_model(core: Core, ctx: Ctx, model: capacity.MemoryModel, *, share: bool = True) -> tuple[Core, list[Action]]:
    """The model changed: kept, shared with the fleet, and the recommendation told when it
    changed."""
    if model == core.learned.capacity:
        return core, []
    new = replace(core, learned=replace(core.learned, capacity=model))
    out: list[Action] = [Persist(), *(_share(new, ctx) if share else [])]
    before, after = _recommended(core, ctx), _recommended(new, ctx)
    if replace(before, points=0) == replace(after, points=0):
        return new, out
    return replace(new, recommendation_told=True), [*out, Emit(after)]


def _share(core: Core, ctx: Ctx) -> list[Action]:
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


def _learn_launch(core: Core, ctx: Ctx, facts: StartupFacts) -> tuple[Core, list[Action]]:
    """A launch's start-up facts, once its CUDA graphs are captured on every rank it names."""
    fraction = core.learned.fraction if core.learned.fraction is not None else facts.mem_fraction_static
    if fraction is None or not capacity.left_after_start(facts):
        return core, []
    return _with_model(core, ctx, core.learned.capacity.launched(_capacity_key(core, ctx), fraction, facts))


def _kv_pressure(core: Core, ctx: Ctx, source: str, detail: str) -> tuple[Core, list[Action]]:
    """A sign that a higher fraction would pay: counted, told at most once per
    ``kv_pressure_every_s`` (with the signals in between), and a climb considered."""
    core = replace(core, kv_pressure_at=ctx.now, kv_signals=core.kv_signals + 1)
    out: list[Action] = []
    if core.kv_told_at is None or ctx.now - core.kv_told_at >= ctx.cfg.policy.kv_pressure_every_s:
        out.append(Emit(ev.KvPressureSeen(source=source, detail=detail[:300], signals=core.kv_signals,
                                          mem_fraction_static=core.learned.fraction)))
        core = replace(core, kv_signals=0, kv_told_at=ctx.now)
    return core, [*out, *_climb_wanted(core, ctx)]


def _climb_wanted(core: Core, ctx: Ctx) -> list[Action]:
    """[AskClimb(f*)] when a climb would pay and is allowed now (docs/capacity.md): climbing
    is on; READY for ``stable_after_s`` with KV pressure seen since; f* above the fraction;
    no climb in ``climb_interval_s`` and none on probation; a server alone only in its window."""
    cfg = ctx.cfg
    p = cfg.policy
    if not p.climb or core.state is not State.READY or core.ready_at is None or core.climb_from is not None:
        return []
    if ctx.now - core.ready_at < p.stable_after_s or core.failures:
        return []
    if core.kv_pressure_at is None or core.kv_pressure_at < core.ready_at:
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


def _fleet_advice(core: Core, advice: FleetAdvice, ctx: Ctx) -> tuple[Core, list[Action]]:
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
            core, out = _with_model(core, ctx, joined, share=False)
        if core.learned.fleet_pending or _record_lacks(core.learned.capacity, advice):
            out += _share(core, ctx)
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


def step(core: Core, event: Event, ctx: Ctx) -> tuple[Core, list[Action]]:
    """The next state and the actions to carry out, for one event."""
    grouped = _group_step(core, event, ctx) if ctx.cfg.group.enabled else None
    new, actions = grouped if grouped is not None else _step(core, event, ctx)
    if ctx.cfg.router.enabled:
        actions = _with_router(core, new, actions, ctx.now)
    return new, actions


def _group_step(core: Core, event: Event, ctx: Ctx) -> tuple[Core, list[Action]] | None:
    """[group]: what a group node does differently (None: as a single server does).

    A node never decides its own relaunch: every end of its server is reported to the group
    and the node waits (WAITING) for the leader's next generation, launched with the group's
    flags. Probes, startup facts, hangs, headroom, stops and the daemon's own stop are the
    single server's rules; only where they would relaunch, the node reports and waits.
    """
    s = core.state
    cfg = ctx.cfg
    match event:
        case Boot() if s is State.STOPPED:
            # STOPPED -> WAITING: nothing is launched before the leader's decision
            return _transition(core, State.WAITING, "waiting for the group's generation")

        case GroupLaunch(number=number, fraction=fraction, hicache_size_gb=hicache, reason=reason) if (
            s is State.WAITING and number > core.generation
        ):
            # WAITING -> PREPARING: the group's flags, not this node's own
            learned = replace(core.learned, fraction=fraction, hicache_size_gb=hicache)
            new, actions = _prepare(replace(core, learned=learned, generation=number),
                                    f"group generation {number}" + (f": {reason}" if reason else ""))
            return new, [*actions, Persist()]

        case GroupEnded(number=number, reason=reason) if number == core.generation:
            if s in (State.STARTING, State.READY):
                # STARTING/READY -> RESTARTING: drained, then WAITING
                return _stop_to_relaunch(core, ctx, Cause.OTHER, f"the group's generation ended: {reason}",
                                         cfg.server.stop_grace_s)
            if s in (State.PREPARING, State.BACKOFF):
                # nothing of ours runs yet: PREPARING -> WAITING (a launch in flight is
                # reported when it ends)
                new, actions = _transition(core, State.WAITING, f"the group's generation ended: {reason}")
                return new, [*actions, GroupReport(number, _group_stop(reason, core.phase), "never launched")]
            return core, []

        case GroupGaveUp(reason=reason) if s not in (State.STOPPING, State.STOPPED, State.GAVE_UP):
            new, actions = _give_up(core, f"the group gave up: {reason}", None)
            if core.pid is not None or s is State.STARTING:
                actions.append(StopServer(cfg.server.stop_grace_s, "the group gave up"))
            return replace(new, pid=core.pid), actions

        case Died() as died if died.main and s is State.RESTARTING:
            return core, [Diagnose(read_log=False, phase=core.phase)]  # a stop we made: we know why

        case Diagnosed(status=status, diagnosis=read) if s in (
            State.STARTING, State.READY, State.EXITED, State.RESTARTING,
        ):
            # -> WAITING: a death of our own is a crash of the group's generation; a stop we
            # made (a hang, headroom, the group's order) is reported with why we made it
            diagnosis = read or _unread(core)
            if s is State.RESTARTING:
                detail = core.pending_detail
                diagnosis = _group_stop(detail, core.phase) if detail.startswith("the group's") else _ours(core)
            record = _crash_record(core, ctx, diagnosis, status.describe(), None)
            learned = replace(core.learned, history=(*core.learned.history, record)[-HISTORY_LIMIT:])
            new, actions = _transition(replace(core, learned=learned, last_cause=diagnosis.cause), State.WAITING,
                                       f"generation {core.generation} ended here: {diagnosis.cause.summary}", pid=None)
            crash = [] if s is State.RESTARTING and diagnosis.evidence[:1] == (GROUP_STOP,) else [Emit(_crash_event(
                core, diagnosis, status, next_fraction=None, next_hicache_size_gb=None, next_retry_s=None,
                failures=core.failures + 1,
            ))]
            return new, [*_cancel_run_timers(), *crash, *actions,
                         GroupReport(core.generation, diagnosis, status.describe())]

        case RestartRequested():
            return core, []  # group.restart_refusal: a node alone cannot restart a group

        case TimerFired(name=Timer.BACKOFF):
            return core, []  # the leader waits out the group's backoff, not the node

    return None


def _group_stop(reason: str, phase: Phase) -> Diagnosis:
    """How a node reports a rank it stopped because the group's generation ended: an echo,
    never the root cause (``core.group.rank_of``)."""
    return Diagnosis(cause=Cause.OTHER, phase=phase, evidence=(GROUP_STOP, reason), phase_source="daemon")


def _unread(core: Core) -> Diagnosis:
    """A crash whose log was not read (nothing ran: the launch failed or never happened)."""
    return Diagnosis(cause=Cause.OTHER, phase=core.phase, evidence=("no server process",), phase_source="daemon")


def _ours(core: Core) -> Diagnosis:
    """Why the daemon stopped the server itself (a hang, headroom, an operator's restart):
    its own finding, whatever the log says."""
    return Diagnosis(cause=core.pending or Cause.OTHER, phase=core.phase, evidence=(core.pending_detail,),
                     phase_source="daemon")


def _with_router(old: Core, new: Core, actions: list[Action], now: float) -> list[Action]:
    """The router's view follows the server, one rule for every edge: taken out first thing
    when it dies (-> EXITED), and before any stop (planned, step-down, hang, daemon stop);
    registered once it is READY."""
    out: list[Action] = []
    removed = False
    if new.state is State.EXITED and old.state is not State.EXITED:
        out.append(RouterRemove(new.reason, now))
        removed = True
    for action in actions:
        if isinstance(action, StopServer) and not removed:
            out.append(RouterRemove(action.reason, now))
            removed = True
        out.append(action)
    if new.state is State.READY and old.state is not State.READY:
        out.append(RouterAdd())
    return out


_FINDING_CAUSES = {
    Finding.PORT_HELD: Cause.PORT_IN_USE,
    Finding.GPU_LOST: Cause.GPU_HW_ERROR,
    Finding.GPU_STUCK: Cause.GPU_MEMORY_STUCK,
    Finding.PREFLIGHT: Cause.PREFLIGHT_FAILED,
    Finding.INTERNAL: Cause.PREFLIGHT_FAILED,
}


def _prepare_cause(failed: PrepareFailed) -> tuple[Cause, bool]:
    """What a failed preparation means, and whether a retry could help: a GPU lost or still
    held by memory nobody releases needs a human; a model that is not there is the finding
    SGLang itself would make a minute later."""
    if failed.finding is Finding.PREFLIGHT and "model_path" in failed.checks:
        return Cause.MODEL_LOAD_ERROR, failed.permanent
    permanent = failed.permanent or failed.finding in (Finding.GPU_LOST, Finding.GPU_STUCK)
    return _FINDING_CAUSES[failed.finding], permanent


def _step(core: Core, event: Event, ctx: Ctx) -> tuple[Core, list[Action]]:
    s = core.state
    cfg = ctx.cfg
    match event:
        case Boot() if s is State.STOPPED:
            # STOPPED -> PREPARING
            return _prepare(core, "daemon started")

        case ConfigChanged():
            learned = core.learned.rebased(cfg)
            return replace(core, learned=learned), ([Persist()] if learned != core.learned else [])

        case Prepared() if s is State.PREPARING:
            # PREPARING -> STARTING
            return _launch(core, ctx, "GPUs free and preflight passed")

        case PrepareFailed(detail=detail) as failed if s is State.PREPARING:
            cause, permanent = _prepare_cause(failed)
            if permanent or not cause.restartable:
                # PREPARING -> GAVE_UP
                return _give_up(core, f"{cause.summary}: {detail}", cause)
            # PREPARING -> BACKOFF
            failures = core.failures + 1
            delay = policy.backoff_delay(failures, cfg.policy, ctx.rng.random())
            new, actions = _transition(
                core, State.BACKOFF, f"{cause.summary}: {detail}", failures=failures,
                last_cause=cause,
            )
            return new, [
                *actions,
                Emit(ev.PreflightRetry(cause=cause, detail=detail, delay_s=delay)),
                SetTimer(Timer.BACKOFF, delay),
            ]

        case Launched(pid=pid) if s is State.STARTING:
            return replace(core, pid=pid), [Persist()]

        case LaunchFailed(error=error) if s is State.STARTING:
            # STARTING -> GAVE_UP: the command itself cannot be run
            return _give_up(core, f"cannot start the server: {error}", Cause.CONFIG_ERROR)

        case TimerFired(name=Timer.PROBE) if s is State.STARTING:
            return core, [Probe()]  # the next poll is set when this one answers

        case TimerFired(name=Timer.PROBE) if s is State.READY:
            # Fixed rate while serving, whatever each probe takes: a hang is then caught
            # after interval x failures + timeout, not failures x (interval + timeout).
            return core, [Probe(read_kv=capacity.METRICS_FLAG in cfg.server.extra_args),
                          SetTimer(Timer.PROBE, cfg.health.interval_s)]

        case ProbeResult(ok=True) if s is State.STARTING:
            return _ready(core, ctx)

        case ProbeResult(ok=False) if s is State.STARTING:
            return core, [SetTimer(Timer.PROBE, cfg.health.startup_poll_s)]

        case ProbeResult(ok=True) if s is State.READY:
            return replace(core, probe_failures=0), []

        case ProbeResult(ok=False, detail=detail) if s is State.READY:
            failures = core.probe_failures + 1
            if failures < cfg.health.failures:
                return replace(core, probe_failures=failures), []
            # READY -> RESTARTING: a hung server cannot drain; SIGQUIT makes SGLang dump its
            # stacks into its log before the group is killed
            why = f"{failures} health probes failed in a row (last: {detail})"
            return _stop_to_relaunch(
                replace(core, probe_failures=failures), ctx, Cause.HANG, why,
                cfg.health.hang_dump_wait_s, StopMode.DUMP,
            )

        case FactsUpdated(facts=facts) if s in (State.STARTING, State.READY):
            learned_now: list[Action] = []
            if core.learned.fraction is None and facts.mem_fraction_static is not None:
                # SGLang chose the fraction: the ladder steps from its choice from now on
                core = replace(core, learned=replace(core.learned, fraction=facts.mem_fraction_static))
                learned_now = [
                    Persist(),
                    Emit(ev.FractionLearned(mem_fraction_static=facts.mem_fraction_static,
                                            source="sglang server_args")),
                ]
            core, learned_model = _learn_launch(core, ctx, facts)
            new, actions = _check_headroom(replace(core, facts=facts), ctx, facts)
            return new, [*learned_now, *learned_model, *actions]

        case TimerFired(name=Timer.STARTUP) if s is State.STARTING:
            # STARTING -> RESTARTING: the hard cap, progress or not
            why = f"not ready after {cfg.health.startup_timeout_s:g} s"
            return _stop_to_relaunch(core, ctx, Cause.STARTUP_TIMEOUT, why, cfg.server.stop_grace_s)

        case TimerFired(name=Timer.SILENCE, last_output_at=last) if s is State.STARTING:
            # A start that still prints lines is making progress, however long it takes.
            limit = cfg.health.startup_silence_s
            since = core.launched_at if last is None else max(last, core.launched_at or last)
            quiet = ctx.now - (ctx.now if since is None else since)
            if quiet < limit:
                return core, [SetTimer(Timer.SILENCE, limit - quiet)]
            # STARTING -> RESTARTING
            why = f"no output for {quiet:.0f} s while starting (limit {limit:g} s)"
            return _stop_to_relaunch(core, ctx, Cause.STARTUP_TIMEOUT, why, cfg.server.stop_grace_s)

        case TimerFired(name=Timer.STABLE) if s is State.READY:
            core = replace(core, failures=0)
            return core, [Emit(ev.Stable(after_s=cfg.policy.stable_after_s)), *_climb_wanted(core, ctx)]

        case TimerFired(name=Timer.PROBATION) if s is State.READY and core.climb_from is not None:
            kept = ev.ClimbKept(mem_fraction_static=core.learned.fraction, probation_s=cfg.policy.probation_s)
            core = replace(core, climb_from=None)
            if core.learned.fraction is None:
                return core, [Emit(kept)]
            core, actions = _with_model(core, ctx, core.learned.capacity.climb_kept(core.learned.fraction))
            return core, [Emit(kept), *actions]

        case GpuFree(least_free_gb=free) if s is State.READY and core.learned.fraction is not None:
            model = core.learned.capacity
            positions = rank_gpus(model.ranks())
            seen = {rank: free[i] for rank, i in positions.items() if i < len(free)}
            return _with_model(core, ctx, model.served(core.learned.fraction, seen))

        case KvSample(token_usage=usage, queue=queue) if s is State.READY:
            # the pool nearly full while requests wait and the queue does not shrink: they wait
            # for KV (a crash it is not)
            waiting = queue > 0 and core.kv_queue is not None and queue >= core.kv_queue
            core = replace(core, kv_queue=queue)
            if usage < cfg.policy.kv_usage_high or not waiting:
                return core, []
            return _kv_pressure(core, ctx, "metrics", f"token_usage {usage:.2f}, #queue-req {queue}")

        case KvPressure(source=source, detail=detail) if s is State.READY:
            return _kv_pressure(core, ctx, source, detail)


        case ClimbAllowed(fraction=fraction) if s is State.READY and _climb_wanted(core, ctx) == [AskClimb(fraction)]:
            # READY -> RESTARTING: drained, relaunched at once at the higher fraction
            rec = core.learned.recommendation(ctx.cfg)
            why = rec.words() if rec.fraction is not None else f"one step up ({rec.missing})"
            words = f"{core.learned.fraction:g} -> {fraction:g}: {why}"
            new, actions = _stop_to_relaunch(replace(core, climb_to=fraction, climb_at=ctx.now), ctx, Cause.CLIMB,
                                             words, cfg.server.stop_grace_s)
            climbed = ev.Climbed(mem_fraction_before=core.learned.fraction, mem_fraction_static=fraction,
                                 kv_tokens_gain=None if rec.gain is None else round(rec.gain, 4), words=why)
            return new, [Emit(climbed), *actions]

        case TimerFired(name=Timer.BACKOFF) if s is State.BACKOFF:
            # BACKOFF -> PREPARING
            return _prepare(core, "backoff elapsed")

        case Died(status=status, pid=pid, title=title) as died if s in (State.STARTING, State.READY):
            # STARTING/READY -> EXITED: noticed at once; the diagnosis comes next. A part's
            # death (a scheduler, the detokenizer): SGLang's main process notices it too,
            # sleeps, then kills its tree; that teardown runs, bounded by the stop grace
            # period, and the main process's death that ends it is diagnosed.
            if died.main:
                how = status.describe() if status else ""
                new, actions = _transition(core, State.EXITED, f"server {how}", pid=None)
                down = Emit(ev.ServerDown(pid=core.pid, title="main", how=how, phase=core.phase,
                                          mem_fraction_static=core.learned.fraction))
                return new, [*_cancel_run_timers(), *actions, down, Diagnose(read_log=True, phase=core.phase)]
            part = f"{title} (pid {pid})"
            new, actions = _transition(core, State.EXITED, f"{part} died", part_died=part)
            down = Emit(ev.ServerDown(pid=pid, title=title, how="process of the server died", phase=core.phase,
                                      mem_fraction_static=core.learned.fraction))
            return new, [
                *_cancel_run_timers(), *actions, down,
                StopServer(cfg.server.stop_grace_s, f"{part} died", StopMode.AWAIT),
            ]

        case Died() as died if died.main:
            # The tree is tidied whatever the state; its log is read only for a crash (a part
            # died first: EXITED) or a stop of ours the log may explain (a hang, a start-up
            # timeout). A planned stop (an operator's restart, a step-down on headroom, a
            # daemon stop, giving up) reads nothing.
            read = s is State.EXITED or (
                s is State.RESTARTING and core.pending not in (Cause.OPERATOR_RESTART, Cause.HEADROOM_LOW, Cause.CLIMB)
            )
            return core, [Diagnose(read_log=read, phase=core.phase)]

        case Diagnosed(status=status, diagnosis=diagnosis) if s in (State.STARTING, State.READY, State.EXITED):
            # EXITED -> BACKOFF or GAVE_UP: any exit we did not ask for is a crash, whatever
            # its code
            return _after_failure(core, ctx, diagnosis=diagnosis or _unread(core), status=status)

        case Diagnosed(diagnosis=diagnosis) if s is State.RESTARTING:
            # RESTARTING -> BACKOFF (or GAVE_UP): the stop we asked for is done
            cause = core.pending or Cause.OTHER
            return _after_failure(
                core, ctx, diagnosis=_ours(core), status=None,
                immediate=cause in (Cause.HEADROOM_LOW, Cause.OPERATOR_RESTART, Cause.CLIMB),
                log_diagnosis=diagnosis,
            )

        case Diagnosed(status=status) if s is State.STOPPING:
            # STOPPING -> STOPPED
            new, actions = _transition(core, State.STOPPED, core.reason, pid=None)
            return new, [
                *actions,
                Emit(ev.ServerStopped(reason=core.reason, exit_code=status.code, signal=status.signal)),
                Exit(0),
            ]

        case GpuLost(detail=detail) if s not in (State.GAVE_UP, State.STOPPED, State.STOPPING):
            new, actions = _give_up(core, f"{Cause.GPU_HW_ERROR.summary}: {detail}", Cause.GPU_HW_ERROR)
            # A server may be up (or its launch in flight, pid not yet known): stop it, and keep
            # its pid so that a stop request waits for its exit (GAVE_UP -> STOPPING).
            if core.pid is not None or s is State.STARTING:
                actions.append(StopServer(cfg.server.stop_grace_s, str(Cause.GPU_HW_ERROR)))
            return replace(new, pid=core.pid), actions

        case StopRequested(reason=reason):
            if s in (State.STARTING, State.READY, State.RESTARTING) or (
                s is State.GAVE_UP and core.pid is not None
            ):
                # STARTING/READY/RESTARTING -> STOPPING
                new, actions = _transition(core, State.STOPPING, reason)
                return new, [
                    *_cancel_run_timers(),
                    *actions,
                    StopServer(cfg.server.stop_grace_s, reason),
                ]
            if s is State.STOPPING:
                return core, []
            # PREPARING/BACKOFF/EXITED/GAVE_UP/STOPPED -> STOPPED: no server to stop
            new, actions = _transition(core, State.STOPPED, reason, pid=None)
            return new, [CancelTimer(Timer.BACKOFF), *actions, Exit(0)]

        case Diagnosed() if s is State.GAVE_UP:
            return replace(core, pid=None), [Persist()]

        case RestartRequested(reason=reason) if s in (State.STARTING, State.READY):
            # STARTING/READY -> RESTARTING: drained, stopped, relaunched with the same flags,
            # at once and without counting as a crash
            return _stop_to_relaunch(core, ctx, Cause.OPERATOR_RESTART, reason, cfg.server.stop_grace_s)

        case RestartRequested(reason=reason) if s is State.BACKOFF or (s is State.GAVE_UP and core.pid is None):
            # BACKOFF/GAVE_UP -> PREPARING: an operator says try now; the crash budget starts afresh
            new, actions = _prepare(replace(core, crash_times=(), failures=0), f"restart requested: {reason}")
            return new, [CancelTimer(Timer.BACKOFF), *actions]

        case FleetAdvice() as advice if s is State.PREPARING:
            return _fleet_advice(core, advice, ctx)

        case FleetShared(entries=entries):
            shared = set(entries)
            left = tuple(o for o in core.learned.fleet_pending if o not in shared)
            if left == core.learned.fleet_pending:
                return core, []
            return replace(core, learned=replace(core.learned, fleet_pending=left)), [Persist()]

    return core, []  # an event that means nothing in this state (e.g. a late probe)


__all__ = ["facts_event", "step"]
