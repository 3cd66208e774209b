"""The daemon's own journal: its notable events as JSON lines in the state directory.

The JSON log goes to stdout (journald, a container's log) and may be gone by the morning;
the journal stays with the state, for ``sglang-supervisor report`` (docs/report.md). Every
event that is not ``quiet`` (the per-probe and per-GPU-sample ones) is one line of
``STATE_DIR/journal.jsonl``::

    {"t": 1764470531.25, "ts": "2026-11-30T02:42:11.250Z", "kind": "crash", "cause": ..., ...}

``t`` is the wall clock (epoch seconds, for the report's time axis), then the event's edge
form (``Event.fields()``), with the launch argv's secrets redacted as in the log
(``core.argv.redact_argv``: ``--api-key ***``; the report's header shows the command) and
evidence cut to ``EVIDENCE_LINES`` lines of ``EVIDENCE_CHARS`` (the first, the one the report
shows whole, to ``FIRST_EVIDENCE_CHARS``), each cut at a space and marked `` …``, never inside
a word. A crash's ``unrecognised`` line (what it could not name, for the report's "Crashes it
could not name") is cut to ``EVIDENCE_CHARS`` too: like the evidence it is a line of SGLang's
own log, already in the server log.

Bounded and rotated: when the file passes ``max_bytes`` it becomes ``journal.jsonl.1`` (the
older ones shift up to ``.N``, ``backups`` of them; the oldest is deleted). With the defaults
(4 MB, 3 backups: 16 MB at most) that is tens of thousands of events, months of nights.

A sink must never block the event loop and never raise: a line is a few hundred bytes
appended to an open file (the page cache, no fsync: microseconds), at most a few a second
even on a bad night; rotation is two renames. A write error is counted, reported once per
episode through ``on_error`` and the line dropped; supervision never sees it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from supervisor.core.argv import redact_argv
from supervisor.core.events import Event
from supervisor.core.model import rfc3339

JOURNAL = "journal.jsonl"
EVIDENCE_LINES = 8
EVIDENCE_CHARS = 500  # each evidence line, the unrecognised line and the basis are cut to this
FIRST_EVIDENCE_CHARS = 2000  # the evidence line itself (a CUDA OOM's is ~700 characters)
LINE_MAX_CHARS = 8192  # one runaway field must not fill the journal


def journal_paths(state_dir: str | os.PathLike[str], backups: int = 64) -> list[Path]:
    """The journal's files, oldest first (``.N`` ... ``.1``, then the current one)."""
    base = Path(state_dir) / JOURNAL
    older = [base.with_name(f"{JOURNAL}.{i}") for i in range(backups, 0, -1)]
    return [p for p in older if p.exists()] + ([base] if base.exists() else [])


def clip(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` characters, else cut at the last space before it,
    with `` …`` (a single word longer than that is cut where it must)."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 2]
    head = cut.rsplit(" ", 1)[0] if " " in cut.strip() else cut
    return head.rstrip() + " …"


def journal_line(event: Event, t: float) -> str:
    """One journal line (with its newline) for ``event`` at wall time ``t``."""
    fields = event.fields()
    if isinstance(fields.get("argv"), list):
        fields["argv"] = redact_argv([str(a) for a in fields["argv"]])
    for name in ("evidence", "log_evidence"):
        if isinstance(fields.get(name), list):
            fields[name] = [clip(str(line), FIRST_EVIDENCE_CHARS if k == 0 else EVIDENCE_CHARS)
                            for k, line in enumerate(fields[name][:EVIDENCE_LINES])]
    for name in ("unrecognised", "basis"):  # one line of SGLang's log, or what a reading rests on
        if isinstance(fields.get(name), str):
            fields[name] = clip(fields[name], EVIDENCE_CHARS)
    ts = rfc3339(t)
    line = json.dumps({"t": round(t, 3), "ts": ts, "kind": event.kind, **fields}, default=str, ensure_ascii=False,
                      separators=(",", ":"))
    if len(line) > LINE_MAX_CHARS:
        line = json.dumps({"t": round(t, 3), "ts": ts, "kind": event.kind, "truncated": len(line)})
    return line + "\n"


def read_journal(state_dir: str | os.PathLike[str], since: float | None = None) -> Iterator[dict[str, Any]]:
    """The journal's records, oldest first, from ``since`` (epoch seconds) on; a torn or
    foreign line is skipped."""
    for path in journal_paths(state_dir):
        try:
            with path.open(encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(record, dict) or not isinstance(record.get("t"), int | float):
                        continue
                    if since is None or record["t"] >= since:
                        yield record
        except OSError:
            continue


class JournalSink:
    """EventSink appending the daemon's notable events to ``STATE_DIR/journal.jsonl``."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        max_bytes: int = 4 * 1024 * 1024,
        backups: int = 3,
        clock: Callable[[], float] = time.time,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.path = Path(state_dir) / JOURNAL
        self.max_bytes = max_bytes
        self.backups = backups
        self._clock = clock
        self._on_error = on_error
        self._file: IO[str] | None = None
        self._size = 0
        self._failing = False
        self.written = 0
        self.errors = 0

    def emit(self, event: Event) -> None:
        """Append ``event`` unless it is a quiet one; never blocks long, never raises."""
        if event.quiet:
            return
        try:
            line = journal_line(event, self._clock())
            f = self._open()
            f.write(line)
            f.flush()  # one write(2) per event: a crash of the daemon loses nothing written
            self._size += len(line.encode())
            self.written += 1
            self._failing = False
            if self._size >= self.max_bytes:
                self._rotate()
        except Exception as exc:  # noqa: BLE001 - a sink must never raise into supervision
            self.errors += 1
            self._close()
            if not self._failing:
                self._failing = True
                if self._on_error is not None:
                    with contextlib.suppress(Exception):
                        self._on_error(f"{self.path}: {exc!r}"[:300])

    def _open(self) -> IO[str]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
            self._size = self._file.tell()
        return self._file

    def _rotate(self) -> None:
        """``journal.jsonl`` -> ``.1`` -> ... -> ``.N``; the oldest beyond ``backups`` goes."""
        self._close()
        if self.backups <= 0:
            self.path.unlink(missing_ok=True)
            return
        self.path.with_name(f"{JOURNAL}.{self.backups}").unlink(missing_ok=True)
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{JOURNAL}.{i}")
            if older.exists():
                older.rename(self.path.with_name(f"{JOURNAL}.{i + 1}"))
        self.path.rename(self.path.with_name(f"{JOURNAL}.1"))

    def _close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None

    def close(self) -> None:
        self._close()
