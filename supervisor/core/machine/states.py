"""What the states without a running launch do (STOPPED, WAITING, PREPARING, EXITED,
RESTARTING, BACKOFF, STOPPING, GAVE_UP), and what every state does alike (``anywhere``)."""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import events as ev
from supervisor.core import policy
from supervisor.core.machine import jobs
from supervisor.core.machine.crash import after_end, ended, group_end, group_stop, ours, prepare_cause
from supervisor.core.machine.edges import (
    Step,
    Variant,
    cancel_run_timers,
    give_up,
    launch,
    prepare,
    stop_server,
    transition,
)
from supervisor.core.machine.learning import fleet_advice
from supervisor.core.messages import (
    Boot,
    CancelTimer,
    ConfigChanged,
    Ctx,
    Diagnose,
    Diagnosed,
    Died,
    Emit,
    Event,
    Exit,
    FleetAdvice,
    FleetShared,
    GpuLost,
    GroupEnded,
    GroupGaveUp,
    GroupLaunch,
    GroupReport,
    HoldRequested,
    Persist,
    Prepared,
    PrepareFailed,
    RestartRequested,
    SetTimer,
    StartRequested,
    StopRequested,
    TimerFired,
)
from supervisor.core.model import Cause, JobKind, State
from supervisor.core.state import Core, Hold, Timer


def stopped(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    held = core.held
    match event:
        case Boot() if held is not None:
            # STOPPED -> STOPPED: an operator's hold outlives the daemon; nothing is launched
            return core, [Persist(), Emit(ev.ServerHeld(reason=held.reason, since=held.since, at_boot=True))]
        case StartRequested(reason=reason) if held is not None:
            return _start(core, reason)
        case Boot() if v.group:
            # STOPPED -> WAITING: nothing is launched before the leader's decision
            return transition(core, State.WAITING, "waiting for the group's generation")
        case Boot():
            # STOPPED -> PREPARING
            return prepare(core, "daemon started")
    return None


def waiting(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    match event:
        case GroupLaunch(number=number, fraction=fraction, hicache_size_gb=hicache, reason=reason) if (
            number > core.generation
        ):
            # WAITING -> PREPARING: the group's flags, not this node's own
            learned = replace(core.learned, fraction=fraction, hicache_size_gb=hicache)
            new, actions = prepare(replace(core, learned=learned, generation=number),
                                   f"group generation {number}" + (f": {reason}" if reason else ""))
            return new, [*actions, Persist()]
    return None


def preparing(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    match event:
        case Prepared():
            # PREPARING -> STARTING
            return launch(core, ctx, "GPUs free and preflight passed")
        case PrepareFailed(detail=detail) as failed:
            cause, permanent = prepare_cause(failed)
            if permanent or not cause.restartable:
                # PREPARING -> GAVE_UP
                return give_up(core, ctx, f"{cause.summary}: {detail}", cause, evidence=detail)
            # PREPARING -> BACKOFF
            failures = core.failures + 1
            delay = policy.backoff_delay(failures, ctx.cfg.policy, ctx.rng.random())
            new, actions = transition(core, State.BACKOFF, f"{cause.summary}: {detail}", failures=failures,
                                      last_cause=cause)
            return new, [*actions, Emit(ev.PreflightRetry(cause=cause, detail=detail, delay_s=delay)),
                         SetTimer(Timer.BACKOFF, delay)]
        case FleetAdvice() as advice:
            return fleet_advice(core, advice, ctx)
    return None


def exited(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    match event:
        case Died() as died if died.main:
            # the part that died first was told; the main process's death that ends its
            # teardown is the one whose log is read
            return core, [Diagnose(read_log=True, phase=core.phase)]
        case Diagnosed(status=status, diagnosis=diagnosis):
            return ended(core, ctx, v, status, diagnosis)
    return None


def restarting(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    job = core.job
    match event:
        case Died() as died if died.main:
            # a stop we made: its log is read only when the log may explain it (a hang, a start
            # that never ended); a planned one reads nothing, and a group node knows why
            read = not v.group and job is not None and job.kind is JobKind.RECOVER
            return core, [Diagnose(read_log=read, phase=core.phase)]
        case Diagnosed(status=status, diagnosis=diagnosis) if job is not None:
            done, told = jobs.finish(core, "stopped")
            if v.group:
                echo = job.kind is JobKind.REGROUP
                reported = group_stop(job.detail, core.phase) if echo else ours(core, job)
                new, actions = group_end(done, ctx, reported, status, echo=echo)
                return new, [*told, *actions]
            # RESTARTING -> PREPARING (planned: at once) or BACKOFF (a hang, a start-up timeout)
            new, actions = after_end(done, ctx, diagnosis=ours(core, job), status=None, job=job,
                                     log_diagnosis=diagnosis)
            return new, [*told, *actions]
    return None


def backoff(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    match event:
        case TimerFired(name=Timer.BACKOFF) if not v.group:  # a group's backoff is its leader's
            # BACKOFF -> PREPARING
            return prepare(core, "backoff elapsed")
    return None


def stopping(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    holding = core.job is not None and core.job.kind is JobKind.HOLD
    match event:
        case Diagnosed(status=status):
            # STOPPING -> STOPPED: the daemon ends there, unless an operator's hold keeps it up
            new, actions = transition(core, State.STOPPED, core.reason, run=replace(core.run, pid=None))
            new, done = jobs.finish(new, "stopped")
            stopped = Emit(ev.ServerStopped(reason=core.reason, exit_code=status.code, signal=status.signal))
            if holding and core.held is not None:
                return new, [*actions, *done, stopped, Emit(ev.ServerHeld(reason=core.held.reason,
                                                                          since=core.held.since))]
            return new, [*actions, *done, stopped, Exit(0)]
        case StopRequested(reason=reason) if holding:
            # the daemon stops while a hold drains: the same stop, now for good (the hold is kept)
            core, cancelled = jobs.cancel(core, by=f"stop: {reason}")
            core, started = jobs.begin(core, JobKind.STOP, None, reason)
            return core, [*cancelled, *started]
        case StopRequested() | HoldRequested() | GpuLost() | GroupGaveUp():
            return core, []  # already stopping
    return None


def gave_up(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    match event:
        case Diagnosed():
            return replace(core, run=replace(core.run, pid=None)), [Persist()]
        case GpuLost() | GroupGaveUp():
            return core, []
    return None


def anywhere(core: Core, event: Event, ctx: Ctx, v: Variant) -> Step | None:
    """What every state does alike, after its own handler passed."""
    s = core.state
    match event:
        case ConfigChanged():
            learned = core.learned.rebased(ctx.cfg)
            return replace(core, learned=learned), ([Persist()] if learned != core.learned else [])
        case FleetShared(entries=entries):
            shared = set(entries)
            left = tuple(o for o in core.learned.fleet_pending if o not in shared)
            if left == core.learned.fleet_pending:
                return core, []
            return replace(core, learned=replace(core.learned, fleet_pending=left)), [Persist()]
        case StopRequested(reason=reason):
            return _stop(core, ctx, v, reason)
        case HoldRequested(reason=reason) if not v.group and core.held is None:  # a node cannot alone
            return _hold(core, ctx, v, reason)
        case StartRequested(reason=reason) if s is State.GAVE_UP and core.pid is None:
            return _start(core, reason)
        case RestartRequested(reason=reason) if not v.group:  # group.restart_refusal: a node cannot alone
            return jobs.restart_requested(core, ctx, v, reason)
        case GpuLost(detail=detail) if s is not State.STOPPED:
            return _give_up_stopping(core, ctx, v, f"{Cause.GPU_HW_ERROR.summary}: {detail}", Cause.GPU_HW_ERROR,
                                     str(Cause.GPU_HW_ERROR))
        case GroupGaveUp(reason=reason) if s is not State.STOPPED:
            return _give_up_stopping(core, ctx, v, f"the group gave up: {reason}", None, "the group gave up")
        case GroupEnded(number=number, reason=reason) if number == core.generation:
            return _group_ended(core, ctx, v, reason)
        case Died() as died if died.main:
            # The tree is tidied whatever the state; nothing of its log is read.
            return core, [Diagnose(read_log=False, phase=core.phase)]
    return None


def _stop(core: Core, ctx: Ctx, v: Variant, reason: str) -> Step:
    """The daemon stops the server for good: a stop job, which cancels every other."""
    s = core.state
    core, cancelled = jobs.cancel(core, by=f"stop: {reason}")
    core, started = jobs.begin(core, JobKind.STOP, None, reason)
    if s in (State.STARTING, State.READY, State.RESTARTING) or (s is State.GAVE_UP and core.pid is not None):
        # STARTING/READY/RESTARTING/GAVE_UP -> STOPPING
        new, actions = transition(core, State.STOPPING, reason)
        return new, [*cancelled, *started, *cancel_run_timers(), *actions,
                     *stop_server(ctx, v, ctx.cfg.server.stop_grace_s, reason)]
    # STOPPED/WAITING/PREPARING/BACKOFF/EXITED/GAVE_UP -> STOPPED: no server to stop
    new, actions = transition(core, State.STOPPED, reason, run=replace(core.run, pid=None))
    new, done = jobs.finish(new, "no server ran")
    return new, [*cancelled, *started, CancelTimer(Timer.BACKOFF), *actions, *done, Exit(0)]


def _hold(core: Core, ctx: Ctx, v: Variant, reason: str) -> Step:
    """An operator's stop: the server is stopped (drained, out of the router first) and kept
    stopped until ``start``; no crash is counted. A hold job, which cancels every other."""
    s = core.state
    core, cancelled = jobs.cancel(core, by=f"stop --server: {reason}")
    core, started = jobs.begin(core, JobKind.HOLD, None, reason)
    held = Hold(reason, ctx.wall_time)
    core = replace(core, held=held)
    why = f"stopped by an operator: {reason}"
    if s in (State.STARTING, State.READY, State.RESTARTING) or (s is State.GAVE_UP and core.pid is not None):
        # STARTING/READY/RESTARTING/GAVE_UP -> STOPPING (held)
        new, actions = transition(core, State.STOPPING, why)
        return new, [*cancelled, *started, *cancel_run_timers(), *actions,
                     *stop_server(ctx, v, ctx.cfg.server.stop_grace_s, why)]
    if s is State.EXITED:
        # EXITED -> STOPPING (held): the dead server's tree is being tidied; held once it is
        new, actions = transition(core, State.STOPPING, why)
        return new, [*cancelled, *started, *cancel_run_timers(), *actions]
    # WAITING/PREPARING/BACKOFF/GAVE_UP/STOPPED -> STOPPED (held): no server to stop
    new, actions = transition(core, State.STOPPED, why, run=replace(core.run, pid=None))
    new, done = jobs.finish(new, "no server ran")
    return new, [*cancelled, *started, CancelTimer(Timer.BACKOFF), *cancel_run_timers(), *actions, *done,
                 Emit(ev.ServerHeld(reason=reason, since=held.since))]


def _start(core: Core, reason: str) -> Step:
    """An operator's start: a held (or given-up) server prepared at once, the crash budget
    afresh. STOPPED/GAVE_UP -> PREPARING."""
    held = core.held
    core, started = jobs.begin(replace(core, held=None, crash_times=(), failures=0), JobKind.START, None, reason)
    new, actions = prepare(core, f"started by an operator: {reason}")
    new, done = jobs.finish(new, "prepared at once")
    released = [Emit(ev.ServerReleased(reason=reason, held_since=held.since))] if held is not None else []
    return new, [*started, *released, *actions, *done]


def _give_up_stopping(core: Core, ctx: Ctx, v: Variant, reason: str, cause: Cause | None, why: str) -> Step:
    # * -> GAVE_UP: a server may be up (or its launch in flight, pid not yet known): it is
    # stopped, its pid kept so that a stop request waits for its exit (GAVE_UP -> STOPPING)
    running = core.pid is not None or core.state is State.STARTING
    core, cancelled = jobs.cancel(core, by=why)
    new, actions = give_up(core, ctx, reason, cause, keep_pid=True)
    stop = stop_server(ctx, v, ctx.cfg.server.stop_grace_s, why) if running else []
    return new, [*cancelled, *actions, *stop]


def _group_ended(core: Core, ctx: Ctx, v: Variant, reason: str) -> Step | None:
    s = core.state
    why = f"the group's generation ended: {reason}"
    if s in (State.STARTING, State.READY):
        # STARTING/READY -> RESTARTING: drained, then WAITING
        return jobs.relaunch(core, ctx, v, JobKind.REGROUP, Cause.OTHER, why, ctx.cfg.server.stop_grace_s)
    if s in (State.PREPARING, State.BACKOFF):
        # nothing of ours runs yet: PREPARING -> WAITING (a launch in flight is reported when it ends)
        new, actions = transition(core, State.WAITING, why)
        return new, [*actions, GroupReport(core.generation, group_stop(reason, core.phase), "never launched")]
    return None


__all__ = ["anywhere", "backoff", "exited", "gave_up", "preparing", "restarting", "stopped", "stopping", "waiting"]
