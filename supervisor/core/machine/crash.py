"""A server's end, recorded and answered: the crash history's line, the crash event, the
policy's answer (BACKOFF, GAVE_UP, or for a planned relaunch PREPARING at once), and, for a
group node, the report to the group."""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import events as ev
from supervisor.core import policy
from supervisor.core.config import unit_name
from supervisor.core.fleet import FleetOom
from supervisor.core.group import GROUP_STOP
from supervisor.core.machine.edges import Step, Variant, cancel_run_timers, give_up, prepare, transition
from supervisor.core.machine.learning import share
from supervisor.core.messages import Action, Ctx, Emit, Finding, GroupReport, PrepareFailed, SetTimer
from supervisor.core.model import Cause, Diagnosis, ExitStatus, JobKind, Phase, Remedy, State
from supervisor.core.policy import Decision
from supervisor.core.state import FLEET_PENDING_LIMIT, HISTORY_LIMIT, Core, CrashRecord, Job, Learned, Timer


def crash_record(core: Core, ctx: Ctx, diagnosis: Diagnosis, exit_text: str,
                 next_fraction: float | None, *, planned: bool = False) -> CrashRecord:
    """The crash as the state file's history keeps it (``core``: as the server died)."""
    return CrashRecord(
        wall_time=ctx.wall_time, cause=diagnosis.cause, remedy=diagnosis.remedy, phase=diagnosis.phase,
        exit=exit_text, fraction=core.learned.fraction, next_fraction=next_fraction,
        evidence=(diagnosis.evidence[0] if diagnosis.evidence else "")[:300], location=diagnosis.location,
        attempt=core.attempt, planned=planned,
    )


def crash_event(core: Core, diagnosis: Diagnosis, status: ExitStatus | None, *, decision: Decision | None,
                failures: int, log_diagnosis: Diagnosis | None = None) -> ev.Crash:
    """The crash event (``core``: as the server died; ``decision``: the policy's answer,
    None for a group node, whose leader decides)."""
    going_on = decision is not None and not decision.give_up
    return ev.Crash(
        cause=diagnosis.cause, remedy=diagnosis.remedy, phase=diagnosis.phase,
        exit_code=status.code if status else None, signal=status.signal if status else None,
        evidence=tuple(diagnosis.evidence), evidence_lineno=diagnosis.evidence_lineno, location=diagnosis.location,
        rank=diagnosis.rank, exc_type=diagnosis.exc_type, exc_message=diagnosis.exc_message,
        mem_fraction_static=core.learned.fraction, hicache_size_gb=core.learned.hicache_size_gb,
        attempt=core.attempt,
        next_mem_fraction_static=decision.fraction if going_on and decision else None,
        next_hicache_size_gb=decision.hicache_size_gb if going_on and decision else None,
        next_retry_s=round(decision.delay_s, 3) if going_on and decision else None,
        consecutive_failures=failures, certain=diagnosis.certain, phase_source=diagnosis.phase_source,
        runner_up=diagnosis.runner_up, min_fraction=diagnosis.min_fraction, part_died=core.run.part_died or None,
        # On a hang or a restart we asked for, what the server's own log said is kept.
        log_cause=None if log_diagnosis is None else log_diagnosis.cause,
        log_evidence=() if log_diagnosis is None else tuple(log_diagnosis.evidence),
        basis=diagnosis.basis, unrecognised=diagnosis.unrecognised, killed=diagnosis.killed,
    )


def _decide(core: Core, ctx: Ctx, diagnosis: Diagnosis, *, crashes: int, failures: int, immediate: bool) -> Decision:
    learned = core.learned
    return policy.decide(
        cause=diagnosis.cause, remedy=diagnosis.remedy, fraction=learned.fraction,
        hicache_size_gb=learned.hicache_size_gb, oom_fractions=learned.ceiling_fractions,
        crashes_in_window=crashes, failures=failures, cfg=ctx.cfg.policy, jitter_sample=ctx.rng.random(),
        immediate=immediate, min_fraction=diagnosis.min_fraction,
    )


def _climb_rules(core: Core, ctx: Ctx, diagnosis: Diagnosis, decision: Decision,
                 job: Job | None) -> tuple[Core, Decision, list[Action]]:
    """A climb relaunches at once at its target, on probation from the last stable fraction;
    a higher fraction that runs out on probation goes back to the last stable one at once."""
    before = core.learned.fraction
    cause = diagnosis.cause
    if decision.give_up:
        return core, decision, []
    if job is not None and job.kind is JobKind.CLIMB and job.target is not None:
        reason = f"{cause.summary}: mem_fraction_static {before:g} -> {job.target:g}"
        return replace(core, climb_from=before), replace(decision, fraction=job.target, reason=reason), []
    on_probation = (core.climb_from is not None and core.climb_at is not None
                    and ctx.now - core.climb_at <= ctx.cfg.policy.probation_s)
    if not on_probation or diagnosis.remedy is not Remedy.FRACTION_DOWN or core.climb_from is None:
        return core, decision, []
    # the failed one is a ceiling from now on (oom_fractions, shared with the fleet)
    back = core.climb_from
    decision = replace(decision, fraction=back, delay_s=0.0, reason=(
        f"{cause.summary} on probation: mem_fraction_static {before:g} -> {back:g} (the last stable one)"))
    fell_back = Emit(ev.ClimbFellBack(mem_fraction_failed=before, mem_fraction_static=back, cause=cause))
    return replace(core, climb_from=None), decision, [fell_back]


def _learn(core: Core, ctx: Ctx, diagnosis: Diagnosis, decision: Decision, record: CrashRecord) -> Learned:
    """What the crash teaches: the fraction that ran out (and, with [fleet], the lesson for
    the fleet: that fraction and the one it led to), the history, the policy's next flags."""
    learned = core.learned
    oom, pending = learned.oom_fractions, learned.fleet_pending
    if diagnosis.remedy is Remedy.FRACTION_DOWN and learned.fraction is not None:
        oom = oom | {learned.fraction}
        if ctx.cfg.fleet.enabled:
            lesson = FleetOom(
                fraction=learned.fraction, next_fraction=None if decision.give_up else decision.fraction,
                when=ctx.wall_time, cause=str(diagnosis.cause), server=unit_name(ctx.cfg), config=ctx.cfg.name,
                key=core.fleet_key,
            )
            pending = (*pending, lesson)[-FLEET_PENDING_LIMIT:]
    return replace(
        learned, oom_fractions=oom, history=(*learned.history, record)[-HISTORY_LIMIT:], fraction=decision.fraction,
        hicache_size_gb=decision.hicache_size_gb, restarts=learned.restarts + (0 if decision.give_up else 1),
        fleet_pending=pending,
    )


def after_end(core: Core, ctx: Ctx, *, diagnosis: Diagnosis, status: ExitStatus | None, job: Job | None = None,
              log_diagnosis: Diagnosis | None = None) -> Step:
    """A server's end that was not a stop for good: recorded, the policy asked; then BACKOFF
    or GAVE_UP, or for a planned relaunch (``job.kind.immediate``: not a crash) PREPARING at once."""
    immediate = job is not None and job.kind.immediate
    before = core.learned.fraction
    crash_times = tuple(t for t in core.crash_times if t >= ctx.now - ctx.cfg.policy.crash_window_s)
    crash_times += () if immediate else (ctx.now,)
    failures = core.failures + (0 if immediate else 1)
    decision = _decide(core, ctx, diagnosis, crashes=len(crash_times), failures=failures, immediate=immediate)
    core, decision, fell_back = _climb_rules(core, ctx, diagnosis, decision, job)
    record = crash_record(core, ctx, diagnosis, status.describe() if status else "stopped by the supervisor",
                          None if decision.give_up else decision.fraction, planned=immediate)
    crashed = [] if immediate else [Emit(crash_event(core, diagnosis, status, decision=decision, failures=failures,
                                                     log_diagnosis=log_diagnosis))]
    ran_out = diagnosis.remedy is Remedy.FRACTION_DOWN and core.learned.fraction is not None
    core = replace(core, learned=_learn(core, ctx, diagnosis, decision, record), crash_times=crash_times,
                   failures=failures, last_cause=diagnosis.cause, recovering_from=diagnosis.cause,
                   run=replace(core.run, pid=None))
    told: list[Action] = [*crashed, *(share(core, ctx) if ran_out else []), *fell_back]
    if decision.give_up:
        new, actions = give_up(core, ctx, decision.reason, diagnosis.cause, evidence=record.evidence)
        return new, [*told, *actions]
    scheduled = Emit(ev.RestartScheduled(
        delay_s=round(decision.delay_s, 3), cause=diagnosis.cause, mem_fraction_static=decision.fraction,
        hicache_size_gb=decision.hicache_size_gb, attempt=core.attempt + 1,
        rung=policy.rung_of(decision.fraction, ctx.cfg.policy.fraction_ladder), mem_fraction_before=before,
    ))
    if immediate:
        # RESTARTING -> PREPARING: a planned relaunch, at once: no backoff, no timer
        new, actions = prepare(core, decision.reason)
        return new, [*told, *cancel_run_timers(), *actions[:-1], scheduled, actions[-1]]
    # STARTING/READY/EXITED/RESTARTING -> BACKOFF
    new, actions = transition(core, State.BACKOFF, decision.reason)
    return new, [*told, *cancel_run_timers(), *actions, scheduled, SetTimer(Timer.BACKOFF, decision.delay_s)]


def group_end(core: Core, ctx: Ctx, diagnosis: Diagnosis, status: ExitStatus, *, echo: bool = False) -> Step:
    # [group] -> WAITING: a death of our own is a crash of the group's generation; a stop we
    # made (a hang, headroom, the group's order: ``echo``) is reported with why we made it
    record = crash_record(core, ctx, diagnosis, status.describe(), None)
    learned = replace(core.learned, history=(*core.learned.history, record)[-HISTORY_LIMIT:])
    new, actions = transition(
        replace(core, learned=learned, last_cause=diagnosis.cause), State.WAITING,
        f"generation {core.generation} ended here: {diagnosis.cause.summary}", run=replace(core.run, pid=None),
    )
    crash = [] if echo else [Emit(crash_event(core, diagnosis, status, decision=None, failures=core.failures + 1))]
    return new, [*cancel_run_timers(), *crash, *actions, GroupReport(core.generation, diagnosis, status.describe())]


def ended(core: Core, ctx: Ctx, v: Variant, status: ExitStatus, diagnosis: Diagnosis | None) -> Step:
    # STARTING/READY/EXITED -> BACKOFF or GAVE_UP (a group node: -> WAITING): any exit we did
    # not ask for is a crash, whatever its code
    read = diagnosis or unread(core)
    return group_end(core, ctx, read, status) if v.group else after_end(core, ctx, diagnosis=read, status=status)


def group_stop(reason: str, phase: Phase) -> Diagnosis:
    """How a node reports a rank it stopped because the group's generation ended: an echo,
    never the root cause (``core.group.rank_of``)."""
    return Diagnosis(cause=Cause.OTHER, phase=phase, evidence=(GROUP_STOP, reason), phase_source="daemon")


def unread(core: Core) -> Diagnosis:
    """A crash whose log was not read (nothing ran: the launch failed or never happened)."""
    return Diagnosis(cause=Cause.OTHER, phase=core.phase, evidence=("no server process",), phase_source="daemon")


def ours(core: Core, job: Job) -> Diagnosis:
    """Why the daemon stopped the server itself (a hang, headroom, an operator's restart):
    its own finding, whatever the log says."""
    return Diagnosis(cause=job.cause or Cause.OTHER, phase=core.phase, evidence=(job.detail,), phase_source="daemon")


_FINDING_CAUSES = {
    Finding.PORT_HELD: Cause.PORT_IN_USE,
    Finding.GPU_LOST: Cause.GPU_HW_ERROR,
    Finding.GPU_STUCK: Cause.GPU_MEMORY_STUCK,
    Finding.PREFLIGHT: Cause.PREFLIGHT_FAILED,
    Finding.INTERNAL: Cause.PREFLIGHT_FAILED,
}


def prepare_cause(failed: PrepareFailed) -> tuple[Cause, bool]:
    """What a failed preparation means, and whether a retry could help: a GPU lost or still
    held by memory nobody releases needs a human; a model that is not there is the finding
    SGLang itself would make a minute later."""
    if failed.finding is Finding.PREFLIGHT and "model_path" in failed.checks:
        return Cause.MODEL_LOAD_ERROR, failed.permanent
    permanent = failed.permanent or failed.finding in (Finding.GPU_LOST, Finding.GPU_STUCK)
    return _FINDING_CAUSES[failed.finding], permanent
