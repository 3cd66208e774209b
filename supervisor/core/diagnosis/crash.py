"""``diagnose``: the whole reading of a crash, from the tail to the ``Diagnosis``."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import replace

from supervisor.core.diagnosis.catalogue import let_go_rows
from supervisor.core.diagnosis.families import _CONSEQUENTIAL, _GENERIC
from supervisor.core.diagnosis.findings import _bind_failure_before_ready, _find
from supervisor.core.diagnosis.kernel import kernel_oom_line
from supervisor.core.diagnosis.limits import INTERNAL_ERROR_TYPE, MAX_EVIDENCE_CHARS
from supervisor.core.diagnosis.lines import tail_text
from supervisor.core.diagnosis.log import _Log
from supervisor.core.diagnosis.phase import _phase_at
from supervisor.core.diagnosis.verdict import _evidence, _from_finding, _other, never_on_a_guess
from supervisor.core.model import Cause, Diagnosis, ExitStatus, Phase, SiteRule


def _diagnose(
    tail: bytes | str,
    exit_status: ExitStatus | None,
    phase: Phase | None,
    kernel_log: str | None,
    pids: Collection[int],
    oom_kill_delta: int | None,
    ready_at: int | None = None,
    site_rules: Sequence[SiteRule] = (),
    hand_rules: bool | Collection[str] = True,
) -> Diagnosis:
    log = _Log(tail_text(tail), lines_after_ready=_lines_after(tail, ready_at))
    if site_rules:
        taught = _site_reading(log, site_rules, phase)
        if taught is not None:
            return taught
    finding, other = _find(log, hand_rules)
    if finding is None or finding.rule.strength != "names":
        finding = _bind_failure_before_ready(log) or finding
    killed = _killed_quietly(log, exit_status) if finding is None or finding.rule.strength == "echo" else None
    if killed is not None:
        diagnosis = killed
    else:
        diagnosis = _from_finding(log, finding, other, phase) if finding else _other(log, phase, exit_status)
    record = kernel_oom_line(kernel_log, pids)
    if record is None and oom_kill_delta is not None and oom_kill_delta > 0:
        record = f"cgroup memory.events: oom_kill +{oom_kill_delta} while the server ran"
    if record and diagnosis.cause in _CONSEQUENTIAL:
        return replace(
            diagnosis,
            cause=Cause.HOST_OOM,
            evidence=(record, *(e for e in diagnosis.evidence if "no OOM-killer record" not in e)),
            evidence_lineno=diagnosis.evidence_lineno if diagnosis.evidence else None,
            remedy_override=None,
            certain=True,
            runner_up=diagnosis.cause if diagnosis.cause is not Cause.OTHER else None,
            min_fraction=None,
        )
    return diagnosis


# Lines that say the server failed, though they name nothing: after one of them, a death by a
# signal is SGLang's own teardown (it SIGKILLs its tree), not a kill from outside.
_FAILURE_MARKS = (*_GENERIC, "traceback (most recent call last)", "kill_process_tree", "crashed", "died",
                  "terminated with", "exit code")


def _killed_quietly(log: _Log, exit_status: ExitStatus | None) -> Diagnosis | None:
    """A main process killed by a signal with nothing logged since it was last ready but
    serving lines (or a peer's echo): a local death of this rank, by that signal."""
    if exit_status is None or exit_status.signal is None or log.ready_index is None:
        return None
    start = log.crash_start
    if log.find_lines(_FAILURE_MARKS, start, last=1):
        return None
    if any(log.exception(i) is not None for i in range(start, log.count)):
        return None
    name = exit_status.describe().removeprefix("killed by ")
    return Diagnosis(
        cause=Cause.OTHER,
        phase=Phase.SERVING,
        evidence=(f"main process killed by {name} after it was ready; no error was logged since",),
        certain=False,
        phase_source="daemon: it was ready" if log.ready_index else "markers: a ready line before the end",
        runner_up=Cause.HOST_OOM if exit_status.signal == 9 else None,
        basis="signal",
        killed=name,
    )


def _site_reading(log: _Log, rules: Sequence[SiteRule], given: Phase | None) -> Diagnosis | None:
    """The first line of the crash (log order) that a site rule matches, read as that rule
    says: its cause, its phase (else the phase read as usual), certain only if it says so."""
    compiled = [(n, rule, re.compile(rule.match, re.IGNORECASE)) for n, rule in enumerate(rules, 1)]
    for i in range(log.crash_start, log.count):
        if log.is_frame(i) or log.is_code(i):
            continue
        text = log.text(i)
        for n, rule, rx in compiled:
            if rx.search(text) is None:
                continue
            _, end = log.logical(i)
            phase, _, source = _phase_at(log, log.report_lines(i, end), i, given)
            if rule.phase is not None:
                phase, source = rule.phase, f"site rule {n}"
            exc = log.exception_near(i)
            header = exc[2] if exc else i
            return Diagnosis(
                cause=rule.cause,
                phase=phase or Phase.STARTING,
                evidence=_evidence(log, [header, *range(i, end + 1)]),
                evidence_lineno=log.lineno(header),
                exc_type=exc[0] if exc else None,
                exc_message=(exc[1][:MAX_EVIDENCE_CHARS] or None) if exc else None,
                location=log.location(header) if exc else None,
                rank=log.rank_near(i),
                certain=rule.certain,
                phase_source=source if phase else "unknown (assumed starting)",
                basis=f"site rule {n}: {rule.match[:120]}",
            )
    return None


def _lines_after(tail: bytes | str, ready_at: int | None) -> int | None:
    """How many line ends the tail holds from ``ready_at`` (a byte offset; a character
    offset for text) on: the lines logged since the server was last ready."""
    if ready_at is None:
        return None
    rest = tail[max(0, ready_at):]
    return rest.count(b"\n") if isinstance(rest, bytes | bytearray | memoryview) else str(rest).count("\n")


def diagnose(
    tail: bytes | str,
    *,
    exit_status: ExitStatus | None = None,
    phase: Phase | None = Phase.STARTING,
    kernel_log: str | None = None,
    pids: Collection[int] = (),
    oom_kill_delta: int | None = None,
    ready_at: int | None = None,
    site_rules: Sequence[SiteRule] = (),
    hand_rules: bool | Collection[str] = True,
) -> Diagnosis:
    """Why the server died, from the tail of its output.

    ``phase`` is what the daemon saw (SERVING once /health answered 200); ``None`` means
    unknown (``explain`` on a file) and lets the log alone decide. ``kernel_log`` is kernel
    messages text; its OOM-killer lines count only for pids in ``pids`` (the server's tree).
    ``oom_kill_delta`` is how many ``oom_kill`` events the service cgroup's ``memory.events``
    counted while this server ran (None: unknown); a positive one is an OOM-killer record.
    ``ready_at`` is where in ``tail`` (a byte offset) the server was last ready, when the
    daemon saw it ready: what was logged before it did not kill the server while serving.
    ``site_rules`` (``[[diagnosis.rule]]``) are tried first, on every line of the crash.
    ``hand_rules=False`` reads with the catalogue and the frames alone (the rules written
    from logs switched off): how it does on words it was never shown; a collection of rule
    names reads with those rules only (a release judged without the rules written after it).
    ``evidence_lineno`` is 1-based within the tail that was read. Never raises.
    """
    try:
        return never_on_a_guess(
            _diagnose(tail, exit_status, phase, kernel_log, pids, oom_kill_delta, ready_at, site_rules, hand_rules))
    except Exception as exc:  # the daemon needs an answer whatever the bytes say
        return Diagnosis(
            cause=Cause.OTHER,
            phase=phase if isinstance(phase, Phase) else Phase.STARTING,
            exc_type=INTERNAL_ERROR_TYPE,
            exc_message=f"{type(exc).__name__}: {exc}"[:MAX_EVIDENCE_CHARS],
            certain=False,
            phase_source="daemon" if isinstance(phase, Phase) else "unknown",
        )
    finally:
        let_go_rows()  # a diagnosis leaves no catalogue rows behind (``FileRows``)


# A crash of every shape the reading takes (a traceback, a frame, an error the catalogue and
# the rules both know): read once by ``warm``, so that each of their tables is built then.
_WARM_LOG = """\
[2026-01-01 00:00:00] The server is fired up and ready to roll!
Traceback (most recent call last):
  File "/usr/lib/python3/site-packages/sglang/srt/managers/scheduler.py", line 1, in event_loop_normal
    result = self.run_batch(batch)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.32 GiB
"""


def warm() -> None:
    """Load what a first diagnosis would (the rules, the catalogue's word index, the module
    table, the system tables of ``meaning``, the start-up functions), off the crash path: the daemon calls it in a thread once a server is READY."""
    from supervisor.core.diagnosis.catalogue import catalogue, modules
    from supervisor.core.diagnosis.meaning import tables
    from supervisor.core.diagnosis.phase import startup_functions

    catalogue()
    modules()
    tables()
    startup_functions()
    diagnose(_WARM_LOG, phase=Phase.SERVING)
