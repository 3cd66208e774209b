"""What the catalogue makes of one log line: the family it names, the entry that says so."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.core.diagnosis import catalogue as _catalogue
from supervisor.core.diagnosis.families import FAMILIES
from supervisor.core.diagnosis.lines import _parse_exception, _strip_prefix

# The families, most specific first: when one line holds several messages of the stack (a
# wrapper and what it wraps, an NCCL error and the CUDA failure under it), the most specific
# is the cause: NCCL failed because a CUDA allocation did.
_SPECIFIC = ("cuda.memory", "cuda.hardware", "cuda.launch", "cuda.toolchain", "cuda.environment", "host.memory",
             "kv_pool.startup", "kv_pool.exhausted", "port.bind", "watchdog", "model.load", "config.args", "nccl.error",
             "nccl.echo", "cuda.other", "hint.memory")


@dataclass(frozen=True, slots=True)
class _Reading:
    """What the catalogue makes of one line: the family it names (None: none), the entry
    that says so, whether an NCCL message carried it, whether the stack prints the line's
    words below error level only, and whether the match is sure: the line holds the whole
    message, or enough of its opening words (``_SURE_LETTERS``) to leave no doubt."""

    family: str | None
    entry: _catalogue.Entry | None
    via_nccl: bool = False
    below: bool = False
    sure: bool = True


_SURE_LETTERS = 2 * _catalogue.MIN_LITERAL_CHARS


def _sure(m: _catalogue.Match) -> bool:
    return m.whole or m.entry.literal >= _SURE_LETTERS


def _resolve(m: _catalogue.Match, depth: int = 0) -> tuple[str | None, _catalogue.Entry, bool, bool]:
    """A match's family: a wrapper's is what it holds when the catalogue knows that (the
    CUDA table's description, another message, read again), nothing when it holds an error
    the catalogue does not know, else its own."""
    entry = m.entry
    nccl = entry.origin.startswith("nvidia-nccl") or "nccl" in entry.pattern.lower() or "cuda failure" in entry.pattern.lower()
    for value in m.values:  # a placeholder that holds a table's entry: "*** SIGBUS received at ...", "error 2 (out of memory)"
        held = _catalogue.catalogue().table_entry(value)
        if held is not None and held.family in FAMILIES:
            return held.family, held, nccl, True
    if m.inner and depth < 3:
        inner = _read_text(m.inner, depth + 1)
        if inner.family is not None and inner.entry is not None:
            return inner.family, inner.entry, nccl or inner.via_nccl, inner.sure
        if _parse_exception(m.inner) is not None or inner.entry is not None:
            return None, entry, nccl, True  # it wraps an error the stack names no cause for
    if entry.names_no_cause(m.whole):
        return None, entry, nccl, True  # its words are shared by messages of other families
    return (entry.family if entry.family in FAMILIES else None), entry, nccl, _sure(m)


def _read_text(text: str, depth: int = 0) -> _Reading:
    cat = _catalogue.catalogue()
    table = cat.match(text, tables=True) if depth else None
    if table is not None:
        return _Reading(table.entry.family if table.entry.family in FAMILIES else None, table.entry,
                        table.entry.origin.startswith("nvidia-nccl"))
    found = cat.matches(text)
    tail = cat.table_tail(text)
    if not found and tail is None:
        return _Reading(None, None)
    primary = cat.primary(found)
    if primary is not None and primary.entry.logged_below_error:
        return _Reading(None, primary.entry, below=True)  # the line is a warning's words, whatever it quotes
    readings = [_resolve(f, depth) for f in found]
    if tail is not None:
        readings.append((tail.family if tail.family in FAMILIES else None, tail, False, True))
    named = [r for r in readings if r[0] is not None]
    if not named:
        return _Reading(None, found[0].entry if found else tail)
    family, entry, nccl, sure = min(named, key=lambda r: (_SPECIFIC.index(r[0]) if r[0] in _SPECIFIC else len(_SPECIFIC),
                                                         not r[3]))
    return _Reading(family, entry, nccl, sure=sure)


def _catalogue_reading(text: str, exc: tuple[str, str] | None) -> _Reading:
    """What the catalogue makes of a line (its exception's message when the line as a whole
    matches nothing).

    The message the line opens with decides the level (``Catalogue.primary``): a warning's
    words are a warning, whatever messages it quotes after them. Of the families the line's
    messages name, the most specific wins (``_SPECIFIC``): a C++ library's message is matched
    piece by piece ("CUDA out of memory. Tried to allocate" and "Including non-PyTorch
    memory" are both in one OOM line), and a wrapper holds what it wraps."""
    body = _strip_prefix(text)
    reading = _read_text(body)
    if reading.entry is None and exc is not None and exc[1]:
        reading = _read_text(exc[1])
    return reading


def read_line(line: str) -> tuple[str | None, _catalogue.Entry | None]:
    """How the diagnosis reads one log line with the catalogue: the family it names (None:
    none, or a line printed below error level) and the entry that says so."""
    reading = _catalogue_reading(line, _parse_exception(line))
    return (None if reading.below else reading.family), reading.entry
