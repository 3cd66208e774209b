"""The phase of a failure (start-up stage or serving), and what says so."""

from __future__ import annotations

import re

from supervisor.core.diagnosis import catalogue as _catalogue
from supervisor.core.diagnosis.lines import _strip_prefix
from supervisor.core.diagnosis.log import _Log
from supervisor.core.diagnosis.markers import _CAPTURE_FRAMES, _SERVING_FRAMES, _STARTUP_FRAMES, _WEIGHTS_FRAMES
from supervisor.core.model import Phase


def _phase_at(
    log: _Log, finding_lines: list[int], index: int, given: Phase | None
) -> tuple[Phase | None, str | None, str]:
    """Phase, startup stage ("weights", "pool", "capture" or None) and what says so.

    In order: a daemon that saw the server serve; the frames of the failure report
    (start-up frames win: they are the outer ones); the last progress line before the
    error; progress lines anywhere in the log (serving lines mean serving; start-up markers
    without a ready line mean start-up); the phase the daemon saw; else unknown.
    """
    if given is Phase.SERVING:
        return Phase.SERVING, None, "daemon"
    report = "".join(log.low(i) + "\n" for i in finding_lines)
    progress = log.nearest_progress(index)
    startup_kw = next((k for k in (*_CAPTURE_FRAMES, *_WEIGHTS_FRAMES, *_STARTUP_FRAMES) if k in report), None)
    if startup_kw is not None:
        source = f"frames: {startup_kw.strip(' =(.')}"
        if any(k in report for k in _CAPTURE_FRAMES):
            return Phase.STARTING, "capture", source
        if any(k in report for k in _WEIGHTS_FRAMES):
            return Phase.STARTING, "weights", source
        stage = progress[0][1] if progress and progress[0][0] is Phase.STARTING else None
        return Phase.STARTING, stage, source
    serving_kw = next((k for k in _SERVING_FRAMES if k in report), None)
    if serving_kw is not None:
        return Phase.SERVING, None, f"frames: {serving_kw}"
    if progress is not None:
        (phase, stage), marker = progress
        return phase, stage, f"markers: last progress line before the error is {marker!r}"
    anywhere = log.progress_anywhere()
    if anywhere is not None:
        (phase, stage), marker = anywhere
        if phase is Phase.SERVING:
            return phase, None, f"markers: {marker!r} in the log"
        return phase, stage, f"markers: {marker!r}, no ready line"
    if given is Phase.STARTING:
        return Phase.STARTING, None, "daemon"
    return None, None, "unknown"


# The functions that print a message say when it can be printed: the catalogue records each
# message's function ("... logger.error in _launch_subprocesses").
_STARTUP_FUNCS = frozenset({"launch", "ready", "init", "initialize", "load", "capture", "warmup", "profile", "dummy",
                            "allocate", "configure", "startup", "subprocesses"})
_SERVING_FUNCS = frozenset({"event", "forward", "batch", "generate", "decode", "prefill", "step", "busy", "serve"})
_ORIGIN_FUNC = re.compile(r" in (\w+)$")
_PRINTER_LINES = 400  # lines of the crash read for a message printed by start-up or serving code only


def _phase_by_printer(log: _Log) -> tuple[Phase, str] | None:
    """The phase the crash's own messages say by the code that prints them: a message of
    the stack printed only by start-up code (SGLang's "Rank <*> scheduler is dead", logged
    while waiting for the schedulers to be ready) means the server never came up."""
    seen: set[Phase] = set()
    said = ""
    for i in range(log.crash_start, min(log.count, log.crash_start + _PRINTER_LINES)):
        if log.is_frame(i) or log.is_code(i) or not log.low(i).strip():
            continue
        found = _catalogue.catalogue().matches(_strip_prefix(log.text(i)))
        primary = _catalogue.catalogue().primary(found)
        m = _ORIGIN_FUNC.search(primary.entry.origin) if primary is not None else None
        if m is None or primary is None:
            continue
        func = m.group(1).lower()
        if func.startswith("__"):
            continue  # a constructor or a dunder runs in any phase
        words = set(func.strip("_").split("_"))
        phase = (Phase.STARTING if words & _STARTUP_FUNCS
                 else Phase.SERVING if words & _SERVING_FUNCS else None)
        if phase is not None:
            seen.add(phase)
            said = said or f"catalogue: {primary.entry.head[:60]!r} is printed by {m.group(1)} ({phase} code)"
    return (seen.pop(), said) if len(seen) == 1 else None
