"""Launches: where one launch of a server begins in its log, and how each one ended.

Pure: functions over text. The daemon writes a marker line to ``server.log`` before each
launch (``launch_marker``; ``supervisor/unit/life.py`` writes with it, ``explain`` reads with
``parse_marker``, so the two cannot drift): ``=== sglang-supervisor launch N at WALL: ARGV``.

How a log is split (``LaunchSplitter``):

- A marker begins a launch. Lines before the first marker (a log that rotated in the middle
  of a launch, or one written before the daemon) are a launch of their own when they hold a
  line that is not blank. Inside a launch begun by a marker, only a marker ends it.
- Without markers, SGLang's READY line (``The server is fired up and ready to roll!``) splits
  a log: the first start-up line (``server_args=``, ``Load weight begin``, the checkpoint
  shards bar) after a READY begins the next launch. Within a launch, what was logged before
  its last READY did not kill it while serving (``diagnose`` already reads from there on).

How a launch ended (``launch_end``):

- ``stopped``: SGLang's SIGTERM drain (``SIGTERM received ... Draining requests and shutting
  down``, ``Gracefully exiting...``; 0.3's ``recive sigterm``) after its last READY, and no
  failure the diagnosis found logged after it.
- ``crashed``: not stopped, and followed by another launch (the daemon relaunched it), or it
  shows a death: a failure the diagnosis found, or a line of the crash chain (SIGQUIT,
  ``crashed with exit code``, a traceback...).
- ``running``: the last launch with neither: no death is logged (still running, or cut short).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from supervisor.core.diagnosis.crash import _FAILURE_MARKS
from supervisor.core.model import Diagnosis

MARKER_PREFIX = "=== sglang-supervisor launch "
READY_WORDS = "ready to roll"  # SGLang: "The server is fired up and ready to roll!"
# The first lines an SGLang launch prints (startup_facts.SOURCE_PATTERNS cites them): after a
# READY, one of them is the next launch's start.
RESTART_WORDS = ("server_args=", "Load weight begin", "Loading safetensors checkpoint shards")
# SGLang's own words for a clean stop (tokenizer_manager.sigterm_handler / sigterm_watchdog;
# 0.3's graceful_shutdown), lowered. "Signal SIGTERM received while ... Force exiting." is not one.
STOP_WORDS = ("draining requests and shutting down", "gracefully exiting", "recive sigterm")

_RESTART = re.compile("|".join(re.escape(words) for words in RESTART_WORDS))
_MARKER = re.compile(r"=== sglang-supervisor launch (\d{1,12}) at (\S{1,64}): ?(.{0,100000})")

Outcome = Literal["crashed", "stopped", "running"]
OUTCOME_WORDS: dict[str, str] = {"crashed": "crashed", "stopped": "stopped cleanly", "running": "still running"}


def launch_marker(attempt: int, wall: str, argv: Sequence[str]) -> str:
    """The line (without its newline) the daemon writes to ``server.log`` before a launch."""
    return f"{MARKER_PREFIX}{attempt} at {wall}: {' '.join(argv)}"


@dataclass(frozen=True, slots=True)
class LaunchMarker:
    """What a marker line says: the daemon's attempt number, the wall time, the command line."""

    attempt: int
    wall: str
    argv: str


def parse_marker(line: str) -> LaunchMarker | None:
    """The marker ``line`` holds (anywhere in it: a journal may prefix it), or None."""
    if MARKER_PREFIX not in line:
        return None
    m = _MARKER.search(line.rstrip("\r\n"))
    return LaunchMarker(int(m.group(1)), m.group(2), m.group(3)) if m else None


class LaunchSplitter:
    """Fed every line of a log in order, says which lines begin a new launch."""

    def __init__(self) -> None:
        self.markers = False  # has a marker begun the current launch
        self._ready = False  # marker-less: has the current launch logged a READY

    def feed(self, line: str) -> LaunchMarker | bool:
        """The marker when ``line`` is one; True when it begins a launch without one; else False."""
        marker = parse_marker(line)
        if marker is not None:
            self.markers, self._ready = True, False
            return marker
        if self.markers:
            return False
        if self._ready and _RESTART.search(line) is not None:
            self._ready = False
            return True
        if READY_WORDS in line:
            self._ready = True
        return False


@dataclass(frozen=True, slots=True)
class LaunchText:
    """One launch of a log: its marker (None without one), its first line's number, its text."""

    marker: LaunchMarker | None
    first_lineno: int
    text: str


def split_launches(text: str) -> list[LaunchText]:
    """The launches of a whole log text, in order (blank text before a marker is none)."""
    splitter = LaunchSplitter()
    found: list[tuple[LaunchMarker | None, int, list[str]]] = []
    for lineno, line in enumerate(text.split("\n"), 1):
        begins = splitter.feed(line)
        if begins is not False or not found:
            if found and found[-1][0] is None and not "".join(found[-1][2]).strip():
                found.pop()  # only blank lines before the first marker
            found.append((begins if isinstance(begins, LaunchMarker) else None, lineno, []))
        found[-1][2].append(line)
    return [LaunchText(marker, first, "\n".join(lines)) for marker, first, lines in found]


@dataclass(frozen=True, slots=True)
class LaunchEnd:
    """How a launch ended, and the line that says it was stopped (1-based in its tail)."""

    outcome: Outcome
    stop_lineno: int | None = None
    stop_line: str | None = None

    @property
    def words(self) -> str:
        return OUTCOME_WORDS[self.outcome]


def launch_end(tail: str, diagnosis: Diagnosis, *, followed: bool) -> LaunchEnd:
    """How the launch whose log ``tail`` is (read as ``diagnosis``) ended; ``followed``: another
    launch came after it. Line numbers count ``\\n`` in ``tail``, as the diagnosis's do."""
    lows = tail.lower().split("\n")
    ready = max((i for i, low in enumerate(lows) if READY_WORDS in low), default=-1)
    stop = next((i for i in range(ready + 1, len(lows)) if any(w in lows[i] for w in STOP_WORDS)), None)
    found = diagnosis.evidence_lineno
    if stop is not None and (found is None or found <= stop + 1):
        return LaunchEnd("stopped", stop + 1, tail.split("\n")[stop].strip()[:300])
    if followed or diagnosis.evidence or diagnosis.exc_type:
        return LaunchEnd("crashed")
    if any(mark in low for low in lows[ready + 1:] for mark in _FAILURE_MARKS):
        return LaunchEnd("crashed")
    return LaunchEnd("running")
