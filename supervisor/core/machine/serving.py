"""What a running server's states do: STARTING (launched, /health not yet 200) and READY
(serving), and what both share (``running``): start-up facts, a death, a stop, a restart."""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import capacity
from supervisor.core import events as ev
from supervisor.core.capacity import rank_gpus
from supervisor.core.machine import jobs
from supervisor.core.machine.crash import ended
from supervisor.core.machine.edges import Step, Variant, cancel_run_timers, give_up, out_of_router, transition
from supervisor.core.machine.learning import (
    check_headroom,
    climb_wanted,
    facts_event,
    kv_pressure,
    learn_launch,
    recommended,
    with_model,
)
from supervisor.core.messages import (
    Action,
    AskClimb,
    CancelTimer,
    ClimbAllowed,
    Ctx,
    Diagnose,
    Diagnosed,
    Died,
    Emit,
    Event,
    FactsUpdated,
    GpuFree,
    KvPressure,
    KvSample,
    Launched,
    LaunchFailed,
    Persist,
    Probe,
    ProbeResult,
    RouterAdd,
    SetTimer,
    StopMode,
    StopServer,
    TimerFired,
)
from supervisor.core.model import Cause, JobKind, StartupFacts, State
from supervisor.core.state import Core, Timer


def starting(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    cfg = ctx.cfg
    match event:
        case Launched(pid=pid):
            return replace(core, run=replace(core.run, pid=pid)), [Persist()]
        case LaunchFailed(error=error):
            # STARTING -> GAVE_UP: the command itself cannot be run
            return give_up(core, ctx, f"cannot start the server: {error}", Cause.CONFIG_ERROR, evidence=error)
        case TimerFired(name=Timer.PROBE):
            return core, [Probe()]  # the next poll is set when this one answers
        case ProbeResult(ok=True):
            return _ready(core, ctx, v)
        case ProbeResult(ok=False):
            return core, [SetTimer(Timer.PROBE, cfg.health.startup_poll_s)]
        case TimerFired(name=Timer.STARTUP):
            # STARTING -> RESTARTING: the hard cap, progress or not
            why = f"not ready after {cfg.health.startup_timeout_s:g} s"
            return jobs.relaunch(core, ctx, v, JobKind.RECOVER, Cause.STARTUP_TIMEOUT, why, cfg.server.stop_grace_s)
        case TimerFired(name=Timer.SILENCE, last_output_at=last):
            # A start that still prints lines is making progress, however long it takes.
            limit = cfg.health.startup_silence_s
            launched = core.run.launched_at
            since = launched if last is None else max(last, launched or last)
            quiet = ctx.now - (ctx.now if since is None else since)
            if quiet < limit:
                return core, [SetTimer(Timer.SILENCE, limit - quiet)]
            # STARTING -> RESTARTING
            why = f"no output for {quiet:.0f} s while starting (limit {limit:g} s)"
            return jobs.relaunch(core, ctx, v, JobKind.RECOVER, Cause.STARTUP_TIMEOUT, why, cfg.server.stop_grace_s)
    return None


def ready(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    cfg = ctx.cfg
    match event:
        case TimerFired(name=Timer.PROBE):
            # Fixed rate while serving, whatever each probe takes: a hang is then caught
            # after interval x failures + timeout, not failures x (interval + timeout).
            return core, [Probe(read_kv=capacity.METRICS_FLAG in cfg.server.extra_args),
                          SetTimer(Timer.PROBE, cfg.health.interval_s)]
        case ProbeResult(ok=True):
            return replace(core, run=replace(core.run, probe_failures=0)), []
        case ProbeResult(ok=False, detail=detail):
            failures = core.run.probe_failures + 1
            core = replace(core, run=replace(core.run, probe_failures=failures))
            if failures < cfg.health.failures:
                return core, []
            # READY -> RESTARTING: a hung server cannot drain; SIGQUIT makes SGLang dump its
            # stacks into its log before the group is killed
            why = f"{failures} health probes failed in a row (last: {detail})"
            return jobs.relaunch(core, ctx, v, JobKind.RECOVER, Cause.HANG, why, cfg.health.hang_dump_wait_s,
                                 StopMode.DUMP)
        case TimerFired(name=Timer.STABLE):
            core = replace(core, failures=0)
            return core, [Emit(ev.Stable(after_s=cfg.policy.stable_after_s)), *climb_wanted(core, ctx)]
        case TimerFired(name=Timer.PROBATION) if core.climb_from is not None:
            kept = ev.ClimbKept(mem_fraction_static=core.learned.fraction, probation_s=cfg.policy.probation_s)
            core = replace(core, climb_from=None)
            if core.learned.fraction is None:
                return core, [Emit(kept)]
            core, actions = with_model(core, ctx, core.learned.capacity.climb_kept(core.learned.fraction))
            return core, [Emit(kept), *actions]
        case GpuFree(least_free_gb=free) if core.learned.fraction is not None:
            model = core.learned.capacity
            seen = {rank: free[i] for rank, i in rank_gpus(model.ranks()).items() if i < len(free)}
            return with_model(core, ctx, model.served(core.learned.fraction, seen))
        case KvSample(token_usage=usage, queue=queue):
            # the pool nearly full while requests wait and the queue does not shrink: they wait
            # for KV (a crash it is not)
            waiting = queue > 0 and core.run.kv_queue is not None and queue >= core.run.kv_queue
            core = replace(core, run=replace(core.run, kv_queue=queue))
            if usage < cfg.policy.kv_usage_high or not waiting:
                return core, []
            return kv_pressure(core, ctx, "metrics", f"token_usage {usage:.2f}, #queue-req {queue}")
        case KvPressure(source=source, detail=detail):
            return kv_pressure(core, ctx, source, detail)
        case ClimbAllowed(fraction=fraction) if climb_wanted(core, ctx) == [AskClimb(fraction)]:
            return _climb(core, ctx, v, fraction)
    return None


def running(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    """STARTING and READY alike."""
    match event:
        case FactsUpdated(facts=facts):
            return _facts(core, ctx, v, facts)
        case Died() as died:
            return _died(core, ctx, v, died)
        case Diagnosed(status=status, diagnosis=diagnosis):
            # a death that did not pass through EXITED: any exit we did not ask for is a crash
            return ended(core, ctx, v, status, diagnosis)
    return None


def _ready(core: Core, ctx: Ctx, v: Variant) -> Step:
    # STARTING -> READY
    run = core.run
    startup_s = ctx.now - (ctx.now if run.launched_at is None else run.launched_at)
    new, actions = transition(core, State.READY, "health probe answered 200", recovering_from=None, gave_up=None,
                              run=replace(run, ready_at=ctx.now, probe_failures=0, kv_queue=None))
    ready = ev.ServerReady(startup_s=round(startup_s, 3), mem_fraction_static=core.learned.fraction,
                           hicache_size_gb=core.learned.hicache_size_gb, attempt=core.attempt)
    out: list[Action] = [CancelTimer(Timer.STARTUP), *actions, Emit(ready)]
    if run.facts is not None:
        out.append(Emit(facts_event(run.facts)))
    if core.recovering_from:
        out.append(Emit(ev.Recovered(
            startup_s=ready.startup_s, mem_fraction_static=ready.mem_fraction_static,
            hicache_size_gb=ready.hicache_size_gb, attempt=ready.attempt, cause=core.recovering_from,
            mem_fraction_before=core.learned.history[-1].fraction if core.learned.history else None,
        )))
    out += [SetTimer(Timer.PROBE, ctx.cfg.health.interval_s), SetTimer(Timer.STABLE, ctx.cfg.policy.stable_after_s)]
    if not new.run.recommendation_told:  # once per launch at least (the metrics after a daemon restart)
        out.append(Emit(recommended(new, ctx)))
        new = replace(new, run=replace(new.run, recommendation_told=True))
    if new.climb_from is not None and new.climb_at is not None:
        out.append(SetTimer(Timer.PROBATION, max(0.0, ctx.cfg.policy.probation_s - (ctx.now - new.climb_at))))
    if v.router:
        out.append(RouterAdd())
    return new, out


def _facts(core: Core, ctx: Ctx, v: Variant, facts: StartupFacts) -> Step:
    learned_now: list[Action] = []
    if core.learned.fraction is None and facts.mem_fraction_static is not None:
        # SGLang chose the fraction: the ladder steps from its choice from now on
        core = replace(core, learned=replace(core.learned, fraction=facts.mem_fraction_static))
        learned_now = [Persist(), Emit(ev.FractionLearned(mem_fraction_static=facts.mem_fraction_static,
                                                          source="sglang server_args"))]
    core, learned_model = learn_launch(core, ctx, facts)
    new, actions = check_headroom(replace(core, run=replace(core.run, facts=facts)), ctx, v, facts)
    return new, [*learned_now, *learned_model, *actions]


def _died(core: Core, ctx: Ctx, v: Variant, died: Died) -> Step:
    # STARTING/READY -> EXITED: noticed at once; the diagnosis comes next. A part's death (a
    # scheduler, the detokenizer): SGLang's main process notices it too, sleeps, then kills
    # its tree; that teardown runs, bounded by the stop grace period, and the main process's
    # death that ends it is diagnosed.
    if died.main:
        how = died.status.describe() if died.status else ""
        new, actions = transition(core, State.EXITED, f"server {how}", run=replace(core.run, pid=None))
        down = Emit(ev.ServerDown(pid=core.pid, title="main", how=how, phase=core.phase,
                                  mem_fraction_static=core.learned.fraction))
        return new, [*out_of_router(ctx, v, new.reason), *cancel_run_timers(), *actions, down,
                     Diagnose(read_log=True, phase=core.phase)]
    part = f"{died.title} (pid {died.pid})"
    new, actions = transition(core, State.EXITED, f"{part} died", run=replace(core.run, part_died=part))
    down = Emit(ev.ServerDown(pid=died.pid, title=died.title, how="process of the server died", phase=core.phase,
                              mem_fraction_static=core.learned.fraction))
    return new, [*out_of_router(ctx, v, new.reason), *cancel_run_timers(), *actions, down,
                 StopServer(ctx.cfg.server.stop_grace_s, f"{part} died", StopMode.AWAIT)]


def _climb(core: Core, ctx: Ctx, v: Variant, fraction: float) -> Step:
    # READY -> RESTARTING: drained, relaunched at once at the higher fraction
    rec = core.learned.recommendation(ctx.cfg)
    why = rec.words() if rec.fraction is not None else f"one step up ({rec.missing})"
    before = core.learned.fraction
    new, actions = jobs.relaunch(replace(core, climb_at=ctx.now), ctx, v, JobKind.CLIMB, Cause.CLIMB,
                                 f"{before:g} -> {fraction:g}: {why}", ctx.cfg.server.stop_grace_s, target=fraction)
    climbed = ev.Climbed(mem_fraction_before=before, mem_fraction_static=fraction,
                         kv_tokens_gain=None if rec.gain is None else round(rec.gain, 4), words=why)
    return new, [Emit(climbed), *actions]
