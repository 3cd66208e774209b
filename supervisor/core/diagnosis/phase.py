"""The phase of a failure (start-up stage or serving), and what says so."""

from __future__ import annotations

import re
from functools import cache

from supervisor.core.diagnosis import catalogue as _catalogue
from supervisor.core.diagnosis import datafiles
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
    if log.ready_index is not None and index >= log.ready_index:
        return Phase.SERVING, None, "markers: the server was ready before the error"
    report = "".join(log.low(i) + "\n" for i in finding_lines)
    progress = log.nearest_progress(index)
    framed = _outermost(report)
    if framed is not None and framed[0] is Phase.STARTING:
        stage, kw = framed[1], framed[2]
        if stage is None:
            stage = progress[0][1] if progress and progress[0][0] is Phase.STARTING else None
        return Phase.STARTING, stage, f"frames: {kw.strip(' =(.')}"
    if framed is not None:
        return Phase.SERVING, None, f"frames: {framed[2]}"
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


STARTUP_FUNCTIONS_FILE = "startup_functions.tsv"
_FRAME_FUNC = re.compile(r'^\s*file "[^"\n]{1,400}", line \d{1,7}, in (\w{1,120})$', re.MULTILINE)


@cache
def startup_functions() -> frozenset[str]:
    """The engines' start-up functions (lowercased), harvested from their sources
    (``scripts/catalogue/functions.py``): a frame in one of them is start-up code."""
    text = datafiles.read_text(STARTUP_FUNCTIONS_FILE)
    return frozenset(line.split("\t", 1)[0].lower() for line in text.splitlines()
                     if line and not line.startswith(("#", "function\t")))


def _outermost(report: str) -> tuple[Phase, str | None, str] | None:
    """The phase the outermost frame with a phase marker says (a traceback lists the outermost
    frame first): a serving loop that calls a loader's helper is serving; an initialisation
    that runs a forward pass (warm-up, profiling, capture) is start-up. The stage is
    "capture" or "weights" when the report holds their words anywhere below start-up."""
    first: tuple[int, Phase, str] | None = None
    for words, phase in ((_CAPTURE_FRAMES, Phase.STARTING), (_WEIGHTS_FRAMES, Phase.STARTING),
                         (_STARTUP_FRAMES, Phase.STARTING), (_SERVING_FRAMES, Phase.SERVING)):
        for kw in words:
            at = report.find(kw)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, phase, kw)
    named = startup_functions()
    for m in _FRAME_FUNC.finditer(report):
        if first is not None and m.start() >= first[0]:
            break
        if m.group(1) in named:
            first = (m.start(), Phase.STARTING, m.group(1))
            break
    if first is None:
        return None
    _, phase, kw = first
    if phase is Phase.SERVING:
        return phase, None, kw
    stage = ("capture" if any(k in report for k in _CAPTURE_FRAMES)
             else "weights" if any(k in report for k in _WEIGHTS_FRAMES) else None)
    return phase, stage, kw


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
