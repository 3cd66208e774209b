"""Findings: what each line of the crash says (catalogue, hand rules, frames), and the
first failure of the crash among them."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from supervisor.core.diagnosis import catalogue as _catalogue
from supervisor.core.diagnosis import kernel, meaning
from supervisor.core.diagnosis.families import (
    _CONFIG_TYPES,
    _GENERIC,
    _MEMORY_FAMILIES,
    _NCCL_MEMORY,
    _PROCESS_EXIT,
    _SKIPPED_SUBSYSTEMS,
    _WEAK_FAMILIES,
    ENVIRONMENT_TYPES,
    ENVIRONMENT_WORDS,
    FAMILIES,
    FRAME_READINGS,
    MEANING_READINGS,
)
from supervisor.core.diagnosis.limits import _BACK_WINDOW, MAX_CANDIDATES
from supervisor.core.diagnosis.lines import _FRAME, _parse_exception, _strip_prefix
from supervisor.core.diagnosis.log import _Log
from supervisor.core.diagnosis.reading import _catalogue_reading, _Reading
from supervisor.core.diagnosis.rule import _LOADER_HINTS, _pinned_host_context, _Rule
from supervisor.core.diagnosis.rules import _NEEDLES, RULES


@dataclass(frozen=True, slots=True)
class _Finding:
    rule: _Rule
    index: int  # the evidence line
    end: int  # last line of its logical line
    support: int  # a supporting line (== index when none)
    basis: str = ""  # what the reading rests on (Diagnosis.basis)
    cited: bool = False  # the evidence is a message of the stack's own code (catalogue or a cited rule)


_RUNNER_UP_LINES = 40  # candidate lines read past the first naming finding, for a runner-up
_STRENGTHS = ("names", "frames", "hint", "echo")
# Words of a line that may report a failure: such lines are looked up in the catalogue.
_ERROR_WORDS = (
    "error", "exception", "fail", "fatal", "abort", "cannot ", "can't ", "unable to", "invalid", "not supported",
    "unsupported", "out of memory", "timed out", "timeout", "refused", "denied", "not found", "no such",
    "mismatch", "exceeded", "insufficient", "illegal", "assert", "corrupt", "segmentation", "killed", "crash",
    "died", "lost", "must be", "expected", "warn", "exit code", "no kernel image", "already in use",
)
# A level word in the log prefix (vLLM, uvicorn, Python logging, c10's glog "[W1130 ...]").
_LEVEL = re.compile(r"(?<![\w-])(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)(?![\w-])|\[([WIEF])\d{3,4} \d\d:\d\d:\d\d")
_BELOW_ERROR = frozenset({"DEBUG", "INFO", "WARNING", "WARN", "W", "I"})


def _explicit_level(text: str) -> str | None:
    """The level a log prefix states, if any (NCCL's "NCCL WARN" reports its errors: not a level)."""
    prefix = text[: len(text) - len(_strip_prefix(text))]
    m = _LEVEL.search(prefix)
    if m is None:
        return None
    return m.group(1) or m.group(2)


def _family_finding(log: _Log, reading: _Reading, i: int, end: int) -> _Finding | None:
    """A catalogue reading as a finding. A CUDA failure raised while allocating pinned host
    memory (its frames say so) is the host's memory, not the device's; a device OOM that an
    NCCL message reports happened where NCCL allocates: at start-up, unless the log says
    otherwise."""
    if reading.family is None or reading.entry is None:
        return None
    rule = FAMILIES[reading.family]
    entry = reading.entry
    basis = f"catalogue: {reading.family}: {entry.origin}"
    if reading.family in ("cuda.memory", "cuda.other") and (pinned := _pinned_host_context(log, i)) is not None:
        return _Finding(FAMILIES["host.memory"], i, end, pinned, basis=f"{basis}; pinned host memory in its frames",
                        cited=True)
    if reading.family == "cuda.memory" and reading.via_nccl:
        rule = _NCCL_MEMORY
    if not reading.sure:
        basis += " (the line holds only its opening words)"
    return _Finding(rule, i, end, i, basis=basis, cited=reading.sure and reading.family not in _WEAK_FAMILIES)


def _environment_finding(log: _Log, i: int, end: int, exc: tuple[str, str] | None) -> _Finding | None:
    """An import or ABI failure (``ImportError``, ``ModuleNotFoundError``, a shared library that
    cannot be opened, an undefined symbol): the environment, whichever package raised it."""
    if exc is None:
        return None
    kind = exc[0].rsplit(".", 1)[-1]
    low = log.low(i)
    if kind not in ENVIRONMENT_TYPES and not any(w in low for w in ENVIRONMENT_WORDS):
        return None
    why = kind if kind in ENVIRONMENT_TYPES else next(w for w in ENVIRONMENT_WORDS if w in low)
    return _Finding(MEANING_READINGS["environment"], i, end, i,
                    basis=f"exception type: {why}: an import or ABI failure is the environment, whichever package raised it")


# What says a SIGBUS hit shared memory: its own words, or a Ray worker (its object store is a
# mapping in /dev/shm; "*** SIGBUS received at time=" is Ray's failure handler, logging.cc).
_SHM_WORDS = ("/dev/shm", " shm", "shm_", "shm-size", "rayworker", "raylet", "ray::", "logging.cc:")


def _meaning_finding(log: _Log, i: int, text: str, end: int, reading: _Reading) -> _Finding | None:
    """What the line's errno, signal or resource words mean (``meaning``), when they decide."""
    value = meaning.errno_in(text)
    name = value.name if value is not None else None
    key, cited = None, False
    if name == "EADDRINUSE":
        key, cited = "port", True
    elif name in ("EACCES", "EPERM") and meaning.binds(text):
        key = "bind_refused"
    elif name == "EADDRNOTAVAIL" and meaning.binds(text):
        key = "address"
    elif name == "ENOSPC" and meaning.SHARED_MEMORY.search(text):
        key, cited = "shared_memory", True
    elif name == "ENOMEM" and meaning.big(text):
        key = "big_enomem"
    elif name == "ENOENT" and meaning.names_model_file(text):
        key, cited = "model_file", True
    if key is None and reading.family not in _MEMORY_FAMILIES and (short := meaning.short_of(text)) is not None:
        key, value = short.replace(" ", "_"), None
        basis = f"meaning: the message says there is too little {short}"
        return _Finding(MEANING_READINGS[key], i, end, i, basis=basis)
    if key is None and value is None and reading.family in (None, *_WEAK_FAMILIES):
        code = meaning.cuda_code_in(text)
        held = _catalogue.catalogue().table_entry(code.name) if code is not None else None
        if code is not None and held is not None and held.family in FAMILIES:
            # the code's name in CUDA's own table ("cudaErrorIllegalAddress"): its family
            return _Finding(FAMILIES[held.family], i, end, i, basis=f"meaning: {code.said()}: {held.family}")
    if key is None and value is None:
        value = meaning.signal_in(text)
        if value is not None and value.name == "SIGBUS":
            shm = log.find_lines(_SHM_WORDS, log.crash_start, last=1)
            if shm:
                return _Finding(MEANING_READINGS["shared_memory"], i, end, shm[0],
                                basis=f"meaning: {value.said()} where the crash names shared memory or a Ray worker")
            key = "sigbus"
    if key is None or value is None:
        return None
    return _Finding(MEANING_READINGS[key], i, end, i, basis=f"meaning: {value.said()}", cited=cited)


def _wraps_another(exc: tuple[str, str]) -> bool:
    """An exception whose message is another exception ("Capture cuda graph failed: TypeError:
    ..."), or a bare ``Exception`` with no message (its text follows on the next lines): its
    own frames are where it was re-raised, not where the error was."""
    message = exc[1].strip()
    if not message:
        return exc[0].rsplit(".", 1)[-1] == "Exception"
    return _parse_exception(message.split(": ", 1)[-1]) is not None


def _frames_finding(log: _Log, i: int, end: int, exc: tuple[str, str]) -> _Finding | None:
    """An exception no rule and no catalogue entry names, read by the code that raised it:
    the innermost frame of its traceback in a subsystem the module table knows."""
    for j in log.traceback_lines(i):
        fm = _FRAME.search(log.text(j))
        if fm is None:
            continue
        path, lineno, func = fm.groups()
        sub: str | None = _catalogue.subsystem(path)
        if any(h in func.lower() for h in _LOADER_HINTS):
            sub = "model_load"  # raised while loading the checkpoint, whatever module holds the loader
        if sub is None or sub in _SKIPPED_SUBSYSTEMS:
            continue
        rule = FRAME_READINGS.get(sub)
        if rule is None:
            return None  # raised in code of no failure family (the scheduler, a model): other
        kind = exc[0].rsplit(".", 1)[-1]
        if sub == "config" and kind not in _CONFIG_TYPES:
            return None
        if sub == "distributed" and kind in _CONFIG_TYPES:
            rule = FRAME_READINGS["config"]  # a validation error in communication code: the parallel layout
        name = path.replace("\\", "/").rsplit("/", 1)[-1]
        return _Finding(rule, i, end, j, basis=f"frames: {name}:{lineno} {func} ({sub}, {_catalogue.module_path(path)})")
    return None


def _rule_finding(rule: _Rule, i: int, end: int, support: int, found: set[str]) -> _Finding:
    cited = any(rule.source_line(n) is not None for n in found & set(rule.needles))
    kind = "rule" if cited else "corpus rule"
    return _Finding(rule, i, end, support, basis=f"{kind} {rule.name}", cited=cited)


def _line_finding(log: _Log, i: int, text: str, end: int, hits: dict[int, set[str]],
                  rules: tuple[_Rule, ...]) -> _Finding | None:
    """What line ``i`` (``text``: its logical line, to ``end``) says of the crash, if anything:
    nothing when it is printed below error level; else the catalogue's family of its message,
    the hand rules for words the catalogue cannot hold (or reads only as CUDA's generic
    words), and, for an exception of new words, the frames that raised it."""
    level = _explicit_level(log.text(i))
    if (level in _BELOW_ERROR and "nccl warn" not in log.low(i)) or "nccl info" in log.low(i):
        return None  # a warning or an information line never killed anything
    exc = log.exception(i)
    environment = _environment_finding(log, i, end, exc)
    if environment is not None:
        return environment
    record = kernel.record_in(text)
    if record is not None:
        return _Finding(MEANING_READINGS[record[0]], i, end, i, basis=f"kernel record: {record[1]}")
    reading = _catalogue_reading(text, exc)
    if reading.below and level is None:
        return None  # the stack prints these words as a warning
    meant = _meaning_finding(log, i, text, end, reading)
    if meant is not None:
        return meant
    finding = _family_finding(log, reading, i, end)
    weak = finding is not None and finding.rule is FAMILIES.get(reading.family or "") \
        and reading.family in _WEAK_FAMILIES and bool(rules)
    if finding is None and reading.entry is not None and reading.entry.family == _PROCESS_EXIT \
            and _SIGKILLED.search(text):
        return _Finding(_SIGKILL_RULE, i, end, i, basis=f"catalogue: {_PROCESS_EXIT}: {reading.entry.origin}",
                        cited=True)
    if (finding is None or weak) and rules:
        found = set().union(*(hits.get(j, ()) for j in range(i, end + 1)))
        for rule in rules:
            support = rule.matches(log, i, text, found)
            if support is not None:
                return _rule_finding(rule, i, end, support, found)
    if finding is None and exc is not None and not any(g in log.low(i) for g in _GENERIC) \
            and not _wraps_another(exc):
        return _frames_finding(log, i, end, exc)
    return finding


def hand_rules_of(which: bool | Collection[str]) -> tuple[_Rule, ...]:
    """The hand rules a reading uses: all (True), none (False), or those named."""
    if isinstance(which, bool):
        return RULES if which else ()
    return tuple(r for r in RULES if r.name in which)


def _find(log: _Log, hand_rules: bool | Collection[str] = True) -> tuple[_Finding | None, _Finding | None]:
    """The first failure of the crash, and the first one of another cause after it.

    Each line that may report a failure is read in log order (``_line_finding``): every
    line of a short crash; in a long one, those with a rule's words, an exception or error
    words. The first line that names a cause wins; else the first frames reading; else the
    first hint (a SIGKILL, an ENOMEM); else the first echo (a closed peer connection, a
    collective timeout), which is then all we have.
    """
    rules = hand_rules_of(hand_rules)
    hits = log.find_needles(_NEEDLES, log.crash_start) if rules else {}
    if log.count - log.crash_start <= MAX_CANDIDATES:
        candidates = set(range(log.crash_start, log.count))  # a short crash: every line is read
    else:
        candidates = set(hits) | set(log.find_lines(_ERROR_WORDS, log.crash_start))
    consumed = -1
    first: dict[str, _Finding] = {}
    found_all: list[_Finding] = []
    after_names = 0
    for i in sorted(candidates)[-MAX_CANDIDATES:]:
        if i <= consumed or log.is_frame(i) or log.is_code(i):
            continue
        if "names" in first:
            after_names += 1
            if after_names > _RUNNER_UP_LINES:
                break
        text, end = log.logical(i)
        consumed = end
        finding = _line_finding(log, i, text, end, hits, rules)
        if finding is None:
            continue
        frames = finding.rule.origin == "frames" and finding.rule.strength == "names"
        first.setdefault("frames" if frames else finding.rule.strength, finding)
        found_all.append(finding)
    chosen = next((first[s] for s in _STRENGTHS if s in first), None)
    if chosen is None:
        return None, None
    other = next((f for f in found_all if f.rule.cause is not chosen.rule.cause and f.rule.strength == "names"), None)
    return chosen, other


_PORT_RULE = next(r for r in RULES if r.name == "port")
_SIGKILL_RULE = next(r for r in RULES if r.name == "sigkill")
_SIGKILLED = re.compile(r"(?:exit ?code|return ?code|terminated with)[:= ]{0,3}-9\b|signal 9\b", re.IGNORECASE)
_BIND_FAILED = ("error while attempting to bind",)
_HTTP_BOUND = ("uvicorn running on",)


def _bind_failure_before_ready(log: _Log) -> _Finding | None:
    """The HTTP server's failed bind just before the last ready line, when nothing after that
    line names a cause: the ready line then came from the warm-up request reaching whatever
    else holds the port (uvicorn says "Uvicorn running on" only once it has bound)."""
    if log.crash_start <= 0:
        return None
    start = max(0, log.crash_start - _BACK_WINDOW)
    failed = [i for i in log.find_lines(_BIND_FAILED, start, last=4) if i < log.crash_start]
    if not failed:
        return None
    index = failed[-1]
    if log.find_lines(_HTTP_BOUND, index, last=1) and log.find_lines(_HTTP_BOUND, index, last=1)[0] < log.crash_start:
        return None
    _, end = log.logical(index)
    return _Finding(_PORT_RULE, index, end, index)
