"""The hand rule (``_Rule``): one way a cause shows in a log line, and the checks a rule
may make around its line (``context``). The rules themselves are in ``rules/``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.core.diagnosis.lines import _strip_prefix
from supervisor.core.diagnosis.log import _Log
from supervisor.core.diagnosis.markers import _CAPTURE_FRAMES, _SERVING_FRAMES, _STARTUP_FRAMES, _WEIGHTS_FRAMES
from supervisor.core.model import Cause, Phase, Remedy


@dataclass(frozen=True, slots=True)
class _Rule:
    """One way a cause shows in a log line."""

    name: str
    cause: Cause
    needles: tuple[str, ...]  # lowercase substrings, any of which makes a line a candidate
    pattern: re.Pattern[str] | None = None  # must also be found in the line
    remedy: Remedy | None = None  # remedy_override the rule implies
    # Must also hold around the line: returns the index of a supporting line (added to the
    # evidence; the line itself when nothing else) or None.
    context: Callable[[_Log, int], int | None] | None = None
    phased: bool = False  # a CUDA OOM: runtime or startup depending on the phase
    usual_phase: Phase | None = None  # the phase when neither the log nor the daemon says
    # The text itself is printed in one phase only (KV-pool sizing at start-up, the batch
    # loop's pool exhaustion while serving): ``usual_phase`` is then known, not guessed.
    phase_in_text: bool = False
    # How much the line tells: "names" (it names the cause), "echo" (a consequence of
    # another failure: a peer's closed connection, a collective timeout) or "hint" (it
    # points at a cause without evidence: a SIGKILL, an ENOMEM). A naming line anywhere in
    # the crash beats a hint, and a hint beats an echo.
    strength: str = "names"
    runner_up: Cause | None = None  # the other reading a hint or an echo leaves open
    # Provenance: where the needles' text comes from ("sglang", "sglang-legacy", "torch",
    # "nccl", "gloo", "cuda", "kernel", "vllm", "ray", "python", "hf", "nvidia-driver"...),
    # per-needle exceptions, and citations of the source line that prints a needle's text.
    origin: str = "sglang"
    origins: tuple[tuple[str, str], ...] = ()  # (needle, origin) where it differs
    cites: tuple[tuple[str, str], ...] = ()  # (needle, "file:line" or a literal of the source)
    # For an "sglang" needle that SGLang's source builds from pieces (an f-string), the
    # literal pieces to find there instead of the needle itself.
    source_text: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def origin_of(self, needle: str) -> str:
        return next((o for n, o in self.origins if n == needle), self.origin)

    def cite_of(self, needle: str) -> str | None:
        return next((c for n, c in self.cites if n == needle), None)

    def source_line(self, needle: str) -> str | None:
        """The needle's citation when it names the source line that prints it (package,
        version, file:line: "sglang 0.5.23 srt/utils/watchdog.py:154"): only such a rule's
        reading may be certain."""
        cite = self.cite_of(needle)
        return cite if cite is not None and _SOURCE_LINE.match(cite) else None

    def matches(self, log: _Log, index: int, text: str, found: set[str]) -> int | None:
        """Whether the line (with ``found`` needles in it) shows this rule; see ``context``."""
        if found.isdisjoint(self.needles):
            return None
        if self.pattern is not None and self.pattern.search(text) is None:
            return None
        return index if self.context is None else self.context(log, index)


_SOURCE_LINE = re.compile(r"[A-Za-z][\w.-]{0,40} \d[\w.+-]{0,20} [\w./-]{1,200}\.\w{1,4}:\d{1,6}\b")


def _ci(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_PINNED_HINTS = ("pin_memory", "pinned", "hostalloc", "host_alloc", "cudahostregister")
_INNERMOST_LINES = 8  # the innermost frames (with their source and caret lines)


def _pinned_host_context(log: _Log, index: int) -> int | None:
    """The CUDA error comes from allocating pinned host memory (a host-memory failure)."""
    for i in [index, *log.traceback_lines(index)[:_INNERMOST_LINES]]:
        low = log.low(i)
        if any(h in low for h in _PINNED_HINTS) or ("memory_pool_host" in low and "init" in low):
            return i
    return None


_LOADER_HINTS = ("load_weights", "weight_loader", "load_model", "model_loader", "load_state_dict")


def _loader_context(log: _Log, index: int) -> int | None:
    """The exception was raised while loading the checkpoint."""
    for i in log.traceback_lines(index):
        if any(h in log.low(i) for h in _LOADER_HINTS):
            return index
    return None


def _raised(log: _Log, index: int) -> int | None:
    """The line is a Python exception line."""
    return index if log.exception(index) is not None else None


def _raised_by(types: tuple[str, ...]) -> Callable[[_Log, int], int | None]:
    """The line is an exception line of one of ``types`` (by their last dotted part)."""

    def check(log: _Log, index: int) -> int | None:
        exc = log.exception(index)
        return index if exc is not None and exc[0].rsplit(".", 1)[-1] in types else None

    return check


def _before_sigquit(log: _Log, index: int) -> int | None:
    """Not after SGLang's own sigquit: past that point it SIGKILLs its own tree."""
    first = log.first_sigquit
    return index if first is None or index < first else None


def _raised_or_validation(log: _Log, index: int) -> int | None:
    """An exception line, or a validation library's message line ("Value error, ...")."""
    if log.exception(index) is not None:
        return index
    body = _strip_prefix(log.text(index)).lower()
    return index if body.startswith(("value error,", "assertion error,")) else None


def _at_startup(log: _Log, index: int) -> int | None:
    """An exception raised while the server was starting (init frames, no serving frames)."""
    if log.exception(index) is None:
        return None
    report = "".join(log.low(i) + "\n" for i in log.traceback_lines(index))
    if any(k in report for k in _SERVING_FRAMES):
        return None
    if any(k in report for k in (*_STARTUP_FRAMES, *_WEIGHTS_FRAMES, *_CAPTURE_FRAMES, "__init__")):
        return index
    return None
