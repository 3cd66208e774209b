"""Specificity: whether a catalogue message's words are its own (issue 35).

Computed from the catalogue alone, never from crash logs, by the generator (``make
catalogue``), which writes each row's ``shared`` column: "" its words are its own; "head" its
opening words recur in other messages (of another family, or of many packages), so only a
line that holds the whole message is evidence; "all" even the whole message recurs: it names
no cause, at most a hint. docs/diagnosis.md ("Specificity") says why the bounds are these.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from supervisor.core.diagnosis.catalogue import Entry, _words, compile_pattern

# A message's words are its own when no message of another family holds them, and the
# messages that do hold them come from at most ``SHARED_PACKAGES`` packages: "Timed out
# after", "Failed to load", "'<*>' object has no attribute" open messages of every family and
# package, and a line that holds only them says nothing of which one it is. "CUDA out of
# memory" opens five messages, all of device memory, in torch and vLLM: its own.
# (docs/diagnosis.md, "Specificity", says why these bounds.)
SHARED_PACKAGES = 3
NAMELESS = frozenset({"generic", "other", "process.exit"})  # families that name no cause


def _echoes(rx: re.Pattern[str], own: int, rows: Sequence[int], entries: Sequence[Entry]) -> list[Entry]:
    return [entries[j] for j in rows if j != own and entries[j].level != "table" and rx.search(entries[j].pattern)]


def _package(entry: Entry) -> str:
    return entry.origin.split(" ", 1)[0]


def _shared(entry: Entry, echoes: list[Entry]) -> bool:
    if entry.family in NAMELESS:
        return False  # it names nothing anyway
    if any(e.family != entry.family for e in echoes):
        return True
    return len({_package(e) for e in echoes} - {_package(entry)}) >= SHARED_PACKAGES


def specificity(entries: Sequence[Entry]) -> list[str]:
    """Each entry's ``shared`` value, computed from the catalogue alone: "all" when even its
    whole message recurs in other messages (``_shared``), "head" when only its opening words
    do, "" when its words are its own. A message recurs in another when its regex finds it in
    that message's pattern (placeholders and all): a line that prints the other would match it."""
    containing: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        for w in _words(e.pattern):
            containing.setdefault(w, []).append(i)
    out = []
    for i, e in enumerate(entries):
        if e.level == "table" or e.family in NAMELESS:
            out.append("")
            continue
        words = _words(e.head)
        if not words:
            out.append("all")  # no word of its own at all
            continue
        rows = containing.get(min(words, key=lambda w: len(containing.get(w, ()))), [])
        if not _shared(e, _echoes(e.regex, i, rows, entries)):
            out.append("")
            continue
        whole = compile_pattern(e.pattern.strip().rstrip(" .!;:,")) if e.head != e.pattern.strip() else e.regex
        out.append("all" if whole is e.regex or _shared(e, _echoes(whole, i, rows, entries)) else "head")
    return out
