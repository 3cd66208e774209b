"""A finding (or none) as a ``Diagnosis``: cause, phase, certainty, remedy, evidence."""

from __future__ import annotations

import re
from dataclasses import replace

from supervisor.core.diagnosis import catalogue as _catalogue
from supervisor.core.diagnosis.families import _GENERIC
from supervisor.core.diagnosis.findings import _Finding, _frames_finding
from supervisor.core.diagnosis.limits import _OTHER_SCAN_LINES, MAX_EVIDENCE_CHARS
from supervisor.core.diagnosis.log import _Log
from supervisor.core.diagnosis.markers import _CLEAR_GPU_STAGES
from supervisor.core.diagnosis.phase import _phase_at, _phase_by_printer
from supervisor.core.model import Cause, Diagnosis, ExitStatus, Phase, Remedy


def _evidence(log: _Log, lines: list[int], support: int | None = None) -> tuple[str, ...]:
    """The error's lines in order, then the line that supports reading it that way."""
    order = sorted(set(lines))
    if support is not None and support not in order:
        order.append(support)
    return tuple(log.text(i).strip()[:MAX_EVIDENCE_CHARS] for i in order)


_PHASE_DEPENDENT = frozenset({Cause.CUDA_OOM_RUNTIME, Cause.CUDA_OOM_STARTUP, Cause.KV_POOL_TOO_SMALL})
_MIN_FRACTION = re.compile(r"raise --mem-fraction-static above ([0-9]{1,3}(?:\.[0-9]{1,6})?)", re.IGNORECASE)
_KILLED_WHO = re.compile(r"Subprocess (\S{1,80}) \(pid=\d{1,10}\)|Rank (\d{1,5}) scheduler|(\w{1,80}) exited with"
                         r"|(Scheduler) or DataParallelController \d{1,10} terminated")


def _killed_summary(log: _Log, f: _Finding) -> str:
    """The line a hint adds to the evidence: what it shows and what it does not."""
    if f.rule.name == "enomem":
        return "ENOMEM from an allocation, no OOM-killer record and no out-of-memory error: not evidence of host OOM"
    if f.rule.name == "ray_worker_died":
        return "worker died; Ray lists the OOM killer among possible causes, no OOM-killer record"
    m = _KILLED_WHO.search(log.text(f.index))
    who = None
    if m:
        who = m.group(1) or (f"rank {m.group(2)} scheduler" if m.group(2) else m.group(3) or "a scheduler")
    return f"{who or 'a server process'} killed by SIGKILL, no OOM-killer record"


def _from_finding(log: _Log, f: _Finding, other: _Finding | None, given: Phase | None) -> Diagnosis:
    rule = f.rule
    phase, stage, source = _phase_at(log, log.report_lines(f.index, f.end), f.index, given)
    if phase is None and rule.usual_phase is not None and rule.phase_in_text:
        phase, source = rule.usual_phase, f"evidence: this message is printed only while {rule.usual_phase}"
    if phase is None:
        printed = _phase_by_printer(log)
        if printed is not None:
            phase, source = printed
    phase_known = phase is not None
    phase = phase or rule.usual_phase or Phase.STARTING
    cause, override = rule.cause, rule.remedy
    if rule.phased:
        cause = Cause.CUDA_OOM_RUNTIME if phase is Phase.SERVING else Cause.CUDA_OOM_STARTUP
        if cause is Cause.CUDA_OOM_STARTUP and stage in _CLEAR_GPU_STAGES:
            override = Remedy.CLEAR_GPU  # the weights/pool did not fit: a lower fraction won't help
    if cause is Cause.KV_POOL_TOO_SMALL and phase is Phase.SERVING:
        override = Remedy.RESTART  # pool exhausted by load: a higher fraction costs activations
    # Certain: the evidence is a message of the stack's own code (a catalogue entry, or a rule
    # citing the line that prints it) that names the cause, and the phase is known where the
    # remedy depends on it. A frames reading, a corpus-only rule or a hint never is.
    certain = rule.strength == "names" and f.cited and (phase_known or cause not in _PHASE_DEPENDENT)
    runner_up = rule.runner_up
    if cause in STARTUP_ONLY and phase is Phase.SERVING and phase_known:
        # a cause that can only happen at start-up, read in a death while serving: not certain,
        # and the runner-up is what the code that raised it says (else other)
        certain = False
        framed = _frames_reading(log, f)
        runner_up = framed if framed is not None and framed is not cause else Cause.OTHER
    if not certain:
        if rule.phased:
            runner_up = Cause.CUDA_OOM_RUNTIME if cause is Cause.CUDA_OOM_STARTUP else Cause.CUDA_OOM_STARTUP
            override = Remedy.FRACTION_DOWN  # either phase: one rung down is the least harm
        elif cause in _MEMORY_CAUSES:
            override = Remedy.RESTART  # never raise the fraction or halve the host cache on a guess
        if runner_up is None and other is not None:
            runner_up = other.rule.cause
    exc = log.exception_near(f.index)
    header = exc[2] if exc else f.index
    text, _ = log.logical(f.index)
    m = _MIN_FRACTION.search(text) if cause is Cause.KV_POOL_TOO_SMALL else None
    evidence = _evidence(log, [header, *range(f.index, f.end + 1)], f.support)
    if rule.strength == "hint":
        evidence = (*evidence, _killed_summary(log, f))
    if rule.origin == "frames":
        evidence = (*evidence, f"read by the code that raised it: {f.basis.removeprefix('frames: ')}")
    if rule.origin == "catalogue" and cause in _MEMORY_CAUSES and not any("memory" in e.lower() for e in evidence):
        # its words do not say memory (cudaHostRegister): the catalogue's family of the message does
        evidence = (*evidence, f"the stack's own message ({f.basis.removeprefix('catalogue: ')})")
    if not phase_known:
        source = f"unknown (assumed {phase}, the usual phase of this error)"
    return Diagnosis(
        cause=cause,
        phase=phase,
        evidence=evidence,
        evidence_lineno=log.lineno(header),
        exc_type=exc[0] if exc else None,
        exc_message=(exc[1][:MAX_EVIDENCE_CHARS] or None) if exc else None,
        location=log.location(header) if exc else None,
        rank=log.rank_near(f.index),
        remedy_override=override if (override is not cause.remedy or not certain) else None,
        min_fraction=float(m.group(1)) if m else None,
        certain=certain,
        phase_source=source,
        runner_up=runner_up if runner_up is not cause else None,
        basis=f.basis,
        unrecognised=None if certain and cause is not Cause.OTHER else _catalogue.normalise(log.text(header).strip())[:300],
    )


_MEMORY_CAUSES = frozenset({*_PHASE_DEPENDENT, Cause.HOST_OOM})
# Causes that can only happen while a server starts: its arguments, its model, its port, the
# start-up's CUDA OOM (``unbalanced``: another process holds part of the GPU at launch).
STARTUP_ONLY = frozenset({Cause.MODEL_LOAD_ERROR, Cause.CONFIG_ERROR, Cause.PORT_IN_USE, Cause.CUDA_OOM_STARTUP})


def _frames_reading(log: _Log, f: _Finding) -> Cause | None:
    """The cause the frames of a finding's exception give (its innermost frame's subsystem)."""
    exc = log.exception_near(f.index)
    if exc is None:
        return None
    framed = _frames_finding(log, exc[2], log.logical(exc[2])[1], (exc[0], exc[1]))
    return framed.rule.cause if framed is not None else None


def never_on_a_guess(d: Diagnosis) -> Diagnosis:
    """Only a certain reading may stop the night: an uncertain one whose remedy would give up
    restarts with backoff instead (the crash-loop give-up ends it if it repeats)."""
    if d.certain or d.remedy is not Remedy.GIVE_UP:
        return d
    return replace(d, remedy_override=Remedy.RESTART)


def _other(log: _Log, given: Phase | None, exit_status: ExitStatus | None) -> Diagnosis:
    """No rule matched: report the first exception of the crash, if any, as ``other``."""
    start = max(log.crash_start, log.count - _OTHER_SCAN_LINES)
    cause = Cause.OTHER
    if exit_status is not None and exit_status.code == 2:  # argparse's exit code
        usage = log.find_lines(("usage:",), start, last=1)
        if usage:
            cause = Cause.CONFIG_ERROR
            return Diagnosis(
                cause, given or Phase.STARTING, _evidence(log, usage[:1]), log.lineno(usage[0]),
                phase_source="daemon" if given else "evidence: argparse exits before start-up",
            )
    killed = exit_status is not None and exit_status.signal == 9
    sigkill = ("main process killed by SIGKILL, no OOM-killer record",) if killed else ()
    for i in range(start, log.count):
        exc = log.exception(i)
        if exc is None or log.is_code(i) or any(g in log.low(i) for g in _GENERIC):
            continue
        _, end = log.logical(i)
        phase, _, source = _phase_at(log, log.report_lines(i, end), i, given)
        return Diagnosis(
            cause=cause,
            phase=phase or Phase.STARTING,
            evidence=(*_evidence(log, list(range(i, end + 1))), *sigkill),
            evidence_lineno=log.lineno(i),
            exc_type=exc[0],
            exc_message=exc[1][:MAX_EVIDENCE_CHARS] or None,
            location=log.location(i),
            rank=log.rank_near(i),
            certain=False,
            phase_source=source if phase else "unknown (assumed starting)",
            runner_up=Cause.HOST_OOM if killed else None,
            unrecognised=_catalogue.normalise(log.text(i).strip())[:300],
        )
    phase, _, source = _phase_at(log, log.report_lines(log.count - 1, log.count - 1), log.count - 1, given)
    return Diagnosis(
        cause=cause,
        phase=phase or Phase.STARTING,
        evidence=sigkill,
        certain=False,
        phase_source=source if phase else "unknown (assumed starting)",
        runner_up=Cause.HOST_OOM if killed else None,
    )
