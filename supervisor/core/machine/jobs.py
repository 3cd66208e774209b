"""Jobs: the requested transitions (restart, climb, step-down, recovery, regroup, stop), in
systemd's sense. A job is queued (``JobQueued``), run (``JobStarted``), then done
(``JobDone``) or cancelled (``JobCancelled``). One runs at a time (``Core.job``); an
operator's restart that cannot run in this state waits (``Core.queued``) for one it can run
in, or is merged into the launch or relaunch already under way.

- restart, climb, step-down: RESTARTING while the server drains; done when it has stopped
  and the relaunch is prepared (RESTARTING -> PREPARING: no backoff, no timer).
- recover (a hang, a start that never ends): RESTARTING, then a crash's backoff; done there.
- regroup ([group]): RESTARTING, then WAITING for the group's next generation; done there.
- stop: STOPPING, done at STOPPED. A stop cancels every other job.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import events as ev
from supervisor.core.machine.edges import Step, Variant, cancel_run_timers, prepare, stop_server, transition
from supervisor.core.messages import Action, CancelTimer, Ctx, Emit, StopMode
from supervisor.core.model import Cause, JobKind, State
from supervisor.core.state import Core, Job, Timer


def _queued(job: Job) -> Emit:
    return Emit(ev.JobQueued(job=job.id, job_type=job.kind, cause=job.cause, detail=job.detail))


def new_job(core: Core, kind: JobKind, cause: Cause | None, detail: str, target: float | None = None) -> tuple[Core, Job]:
    job = Job(core.jobs + 1, kind, cause, detail, target)
    return replace(core, jobs=job.id), job


def begin(core: Core, kind: JobKind, cause: Cause | None, detail: str, target: float | None = None) -> Step:
    """A job queued and run at once: it is ``core.job`` from here on."""
    core, job = new_job(core, kind, cause, detail, target)
    started = Emit(ev.JobStarted(job=job.id, job_type=kind, detail=detail))
    return replace(core, job=job), [_queued(job), started]


def finish(core: Core, detail: str) -> Step:
    """The running job did what it was for."""
    job = core.job
    if job is None:
        return core, []
    return replace(core, job=None), [Emit(ev.JobDone(job=job.id, job_type=job.kind, detail=detail))]


def cancel(core: Core, by: str) -> Step:
    """Every job, running or waiting, superseded (a stop, a give-up)."""
    out: list[Action] = [
        Emit(ev.JobCancelled(job=j.id, job_type=j.kind, by=by)) for j in (core.job, core.queued) if j is not None
    ]
    return replace(core, job=None, queued=None), out


def relaunch(core: Core, ctx: Ctx, v: Variant, kind: JobKind, cause: Cause, detail: str, grace_s: float,
             mode: StopMode = StopMode.DRAIN, target: float | None = None) -> Step:
    # STARTING/READY -> RESTARTING: the server stopped (drained, or its stacks dumped) to be
    # relaunched; what follows its stop is the job's (``after_restarting``)
    core, started = begin(core, kind, cause, detail, target)
    new, actions = transition(core, State.RESTARTING, f"{cause.summary}: {detail}")
    return new, [*started, *cancel_run_timers(), *actions, *stop_server(ctx, v, grace_s, str(cause), mode)]


def restart_requested(core: Core, ctx: Ctx, v: Variant, reason: str) -> Step:
    """An operator's restart: drained and relaunched at once with the same flags, without
    counting as a crash; after a give-up or in backoff, prepared at once with the crash
    budget afresh. Elsewhere it waits, or is merged into what is under way."""
    s = core.state
    if s in (State.STARTING, State.READY):
        return relaunch(core, ctx, v, JobKind.RESTART, Cause.OPERATOR_RESTART, reason, ctx.cfg.server.stop_grace_s)
    core, job = new_job(core, JobKind.RESTART, Cause.OPERATOR_RESTART, reason)
    running = core.job
    if s is State.PREPARING or (running is not None and running.kind.immediate):
        merged = "the launch being prepared" if s is State.PREPARING else f"job {running.id if running else 0}"
        return core, [_queued(job), Emit(ev.JobDone(job=job.id, job_type=job.kind, detail=f"merged into {merged}"))]
    if s in (State.STOPPING, State.STOPPED):
        return core, [_queued(job), Emit(ev.JobCancelled(job=job.id, job_type=job.kind, by="the server is stopping"))]
    return replace(core, queued=job), [_queued(job)]  # ``step`` runs it (``advance``) if it can run now


def advance(core: Core, actions: list[Action]) -> Step:
    """After a step: a waiting restart runs once the state allows it (BACKOFF, or GAVE_UP with
    no server left), is merged into a launch being prepared, or cancelled by a stop."""
    job = core.queued
    if job is None or core.job is not None:
        return core, actions
    s = core.state
    if s is State.BACKOFF or (s is State.GAVE_UP and core.pid is None):
        # BACKOFF/GAVE_UP -> PREPARING: an operator says try now; the crash budget starts afresh
        core = replace(core, queued=None, crash_times=(), failures=0)
        new, prepared = prepare(core, f"restart requested: {job.detail}")
        return new, [*actions, Emit(ev.JobStarted(job=job.id, job_type=job.kind, detail=job.detail)),
                     CancelTimer(Timer.BACKOFF), *prepared,
                     Emit(ev.JobDone(job=job.id, job_type=job.kind, detail="prepared at once"))]
    if s is State.PREPARING:
        done = Emit(ev.JobDone(job=job.id, job_type=job.kind, detail="merged into the launch being prepared"))
        return replace(core, queued=None), [*actions, done]
    if s in (State.STOPPING, State.STOPPED):
        return replace(core, queued=None), [*actions, Emit(ev.JobCancelled(job=job.id, job_type=job.kind,
                                                                           by="the server is stopping"))]
    return core, actions
