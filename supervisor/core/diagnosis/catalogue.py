"""The messages the serving stack can print, harvested from its own code (issue 23).

``scripts/catalogue/harvest.py`` (``make catalogue``) reads pinned releases of SGLang, torch (its Python and the
strings of its shared libraries), NCCL, the CUDA runtime, Triton, FlashInfer, sgl-kernel, vLLM, transformers,
safetensors, huggingface_hub, uvicorn and asyncio, and writes every message it finds as a normalised pattern with
its origin and a **family** to ``supervisor/core/diagnosis/data/catalogue.tsv``; the module trees of the same
releases become ``supervisor/core/diagnosis/data/modules.tsv`` (a module path -> the subsystem it belongs to).
Nothing here is typed by hand from logs: the words come from the code that prints them.

This module is pure: it reads its two data files (package data, once, on first use) and matches log lines against
them. ``normalise`` is the one normaliser: the harvester applies it to the literal text of each message, the
diagnosis to each log line, so a number, a path, a size or an id is the same placeholder on both sides.

A pattern is literal text with placeholders: ``<*>`` where the source formats a value (an f-string expression,
``%s``, ``{}``), and the normaliser's own tokens (``<n>``, ``<size>``, ``<path>``, ``<hex>``, ``<id>``) where the
source's literal holds one. A line matches a pattern when the pattern occurs in the normalised line, each ``<*>``
standing for any short run of text (case is ignored).
"""

from __future__ import annotations

import os
import re
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from itertools import chain
from pathlib import Path
from typing import overload

from supervisor.core.diagnosis.datafiles import DATA_DIR, read_text

ANY = "<*>"
ANY_CHARS = 240  # what one <*> may stand for in a line
MIN_LITERAL_CHARS = 12  # an entry's literal letters; fewer say too little to match on

# --------------------------------------------------------------------------- normalising

_NORMALISERS: tuple[tuple[re.Pattern[str], str], ...] = (
    # ids first: a uuid, a long hex digest or a hex address would otherwise become numbers
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), "<id>"),
    (re.compile(r"\b0x[0-9a-fA-F]{1,32}\b"), "<hex>"),
    (re.compile(r"\b(?=[0-9a-f]{0,63}[a-f])(?=[0-9a-f]{0,63}\d)[0-9a-f]{16,64}\b"), "<hex>"),
    # paths: two or more components (a file name alone stays: "scheduler.py" is a word), never
    # ending in a full stop: "Unrecognized model in /models/x. Should have" keeps its sentence
    (re.compile(r"(?:[A-Za-z]:)?(?:[~.]{0,2}/[\w.@+=:-]{1,200}){2,40}/?(?<!\.)"), "<path>"),
    # sizes before bare numbers: "2.00 GiB", "839.72 MiB", "1024 bytes"
    (re.compile(r"(?<![\w.])\d{1,20}(?:\.\d{1,12})? ?(?:[KMGTP]i?B|bytes?)\b", re.IGNORECASE), "<size>"),
    (re.compile(r"(?<![\w<])[-+]?\d{1,40}(?:\.\d{1,40})?(?:e[-+]?\d{1,4})?(?![\w>])", re.IGNORECASE), "<n>"),
)
_SPACE = re.compile(r"\s+")
_PLACEHOLDER = re.compile(r"<(?:\*|n|size|path|hex|id)>")


def normalise(text: str) -> str:
    """``text`` with ids, addresses, paths, sizes and numbers as placeholders, runs of white
    space as one space, stripped. Idempotent: ``normalise(normalise(t)) == normalise(t)``."""
    for pattern, token in _NORMALISERS:
        text = pattern.sub(token, text)
    return _SPACE.sub(" ", text).strip()


def literal_chars(pattern: str) -> int:
    """How many letters a pattern holds outside its placeholders."""
    return sum(map(str.isalpha, _PLACEHOLDER.sub("", pattern)))


# --------------------------------------------------------------------------- entries


@dataclass(frozen=True, slots=True)
class Entry:
    """One message of the stack.

    ``level`` is how it is printed: ``exception`` (raised; ``origin`` names the type),
    ``critical``/``error``/``warning``/``info``/``debug`` (a logging call), ``warn`` (a
    library's own warning print, NCCL's ``WARN``), ``lib`` (a string in a shared library,
    its use unknown), ``table`` (an error table's description: ``cudaGetErrorString``,
    ``ncclGetErrorString``). ``seen_in`` lists every ``dist==version`` it was found in.
    """

    family: str
    level: str
    pattern: str
    origin: str
    seen_in: tuple[str, ...] = ()
    # Whether the message's words are its own (``shared``): "" they are; "head" its opening
    # words recur in messages of another family or of many packages, so only a line that holds
    # the whole message is evidence; "all" even the whole message does: it names no cause.
    shared: str = ""
    # What a line must hold: the pattern's first sentences, enough of them to say something
    # (``HEAD_LETTERS``), without the closing punctuation (``head_of``; given: the index's).
    head: str = field(default="", repr=False, compare=False)
    literal: int = field(default=-1, repr=False, compare=False)  # letters of the head outside placeholders
    # The head's longest literal piece, lowercased: a line without it cannot match (checked before the regex).
    piece: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.literal < 0:
            head, literal = _head(self.pattern)
            object.__setattr__(self, "head", self.pattern if head == self.pattern else head)  # one string
            object.__setattr__(self, "literal", literal)
        object.__setattr__(self, "piece", max(self.head.lower().split(ANY), key=len))  # not interned: rows come and go

    @property
    def regex(self) -> re.Pattern[str]:
        """The head's regex, compiled when first needed (most entries never are)."""
        return compile_pattern(self.head)

    @property
    def wrapper(self) -> bool:
        """The message ends in what it wraps ("CUDA error: <*>", "... set an error? Error <*>:
        <*>"): the diagnosis reads that."""
        return self.pattern.rstrip().endswith(ANY)

    def names_no_cause(self, whole: bool) -> bool:
        """Whether a line that holds this message (``whole``: all of it, else its head) still
        says nothing of a family: its words are shared (``specificity``)."""
        return self.shared == "all" or (self.shared == "head" and not whole)

    @property
    def logged_below_error(self) -> bool:
        """Printed as a warning or information: never the cause of a death. (NCCL's ``WARN``
        is not: it is the only level NCCL reports its failures at.)"""
        return self.level in ("warning", "info", "debug")


HEAD_LETTERS = MIN_LITERAL_CHARS  # a message's opening words identify it ("CUDA out of memory.")


def head_of(pattern: str) -> str:
    """The part of a message a line must hold to match it: its opening words, up to the
    placeholder or the sentence end after which it holds ``HEAD_LETTERS`` literal letters,
    without closing punctuation. A release may add to a message ("..., error: %s (%d)", a
    sentence of advice), and a pasted log often cuts a long line: the words that open a
    message are what identify it. (``Match.whole`` says when the line holds all of it.)"""
    return _head(pattern)[0]


def _head(pattern: str) -> tuple[str, int]:
    """``head_of`` and its ``literal_chars``, counted once (a row read for a first diagnosis)."""
    text = pattern.strip()
    for cut in _HEAD_CUTS.finditer(text):
        head = text[: cut.start()].rstrip(" .!;:,(")
        literal = literal_chars(head)
        if literal >= HEAD_LETTERS and len(_HEAD_WORD.findall(_PLACEHOLDER.sub(" ", head))) >= HEAD_WORDS:
            return head, literal
    head = text.rstrip(" .!;:,") or text
    return head, literal_chars(head)


HEAD_WORDS = 3  # and three words: "Special token <*>" says nothing yet
_HEAD_WORD = re.compile(r"[A-Za-z]{2,}")
_HEAD_CUTS = re.compile(r"(?=<\*>)|(?<=[.!?;])\s+(?=\S)|$")


COMPILED_KEPT = 1024  # the regexes kept: every diagnosis of the 233-log corpus compiles 571


@lru_cache(maxsize=COMPILED_KEPT)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """The regex of a pattern: its literal pieces escaped, each ``<*>`` a bounded lazy run.
    A leading ``<*>`` is dropped: a match then begins where the message's own words do."""
    while pattern.startswith(ANY):
        pattern = pattern[len(ANY):].lstrip()
    pieces = pattern.split(ANY)
    body = f"(.{{0,{ANY_CHARS}}}?)".join(re.escape(p) for p in pieces)
    return re.compile(body, re.IGNORECASE)


_WORD = re.compile(r"[a-z][a-z_]{3,}")
_CUDA_WORDS = re.compile(r"\bcu(?:da|result|blas|dnn|mem)|\bnccl|\bgpu\b|\bdevice\b")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(_PLACEHOLDER.sub(" ", text.lower())))


@dataclass(frozen=True)
class Match:
    """A line's best catalogue entry, and the text a wrapper's ``<*>`` held (when the entry
    wraps another error: ``CUDA error: <*>``)."""

    entry: Entry
    inner: str | None = None
    start: int = 0  # where in the normalised line it begins
    whole: bool = True  # the whole message is in the line, not only its head
    values: tuple[str, ...] = ()  # what its placeholders held in the line


class Index:
    """Which rows a line's words bring up: each entry under one rare word of its head, the
    few with no word (``unindexed``), and the error tables' rows. The words are one sorted
    list and the rows of all of them one flat array (a word's rows are a slice of it): the
    daemon holds about 1 MB for 42,000 rows, not the megabytes of a dict of tuples of ints."""

    def __init__(self, by_word: Iterable[tuple[str, Iterable[int]]], unindexed: Iterable[int],
                 tables: Iterable[int]) -> None:
        self._words: list[str] = []
        self._starts = array("I", [0])
        self._rows = array("I")
        for word, rows in by_word:  # sorted by word
            if self._words and word <= self._words[-1]:
                raise ValueError(f"catalogue index: {word!r} is out of order")
            self._words.append(word)
            self._rows.extend(rows)
            self._starts.append(len(self._rows))
        self.unindexed = tuple(unindexed)
        self.tables = tuple(tables)

    def rows(self, word: str) -> Sequence[int]:
        at = bisect_left(self._words, word)
        if at == len(self._words) or self._words[at] != word:
            return ()
        return self._rows[self._starts[at]:self._starts[at + 1]]

    def words(self) -> list[tuple[str, Sequence[int]]]:
        """Every word with its rows, sorted by word."""
        return [(w, self.rows(w)) for w in self._words]


def build_index(entries: Sequence[Entry]) -> Index:
    """Each entry under the rarest of its head's words (a line must hold the head)."""
    frequency: dict[str, int] = {}
    words = [_words(e.head) for e in entries]
    for ws in words:
        for w in ws:
            frequency[w] = frequency.get(w, 0) + 1
    by_word: dict[str, list[int]] = {}
    unindexed: list[int] = []
    for i, ws in enumerate(words):
        if not ws:
            unindexed.append(i)
            continue
        key = min(ws, key=lambda w: (frequency[w], -len(w), w))
        by_word.setdefault(key, []).append(i)
    tables = (i for i, e in enumerate(entries) if e.level == "table")
    return Index(sorted(by_word.items()), unindexed, tables)


class Catalogue:
    """Entries indexed by one rare word each, so a line is checked against few regexes.

    ``entries`` may be a list, or the committed file's rows read one by one when a line's
    words first bring them up (``FileRows``: the daemon never holds the 42,000 of them)."""

    def __init__(self, entries: Iterable[Entry], versions: Sequence[str] = (), index: Index | None = None) -> None:
        self.entries: Sequence[Entry] = entries if isinstance(entries, Sequence) else tuple(entries)
        self.versions = tuple(versions)
        self._index = index if index is not None else build_index(self.entries)
        self._tables = [self.entries[i] for i in self._index.tables]
        self._table_text = {e.pattern.strip(" .").lower(): e for e in reversed(self._tables)}

    def __len__(self) -> int:
        return len(self.entries)

    def candidates(self, normalised: str) -> list[Entry]:
        rows = self.entries
        found: list[Entry] = [rows[i] for i in self._index.unindexed]
        for w in _words(normalised):
            found.extend(rows[i] for i in self._index.rows(w))
        return found

    def match(self, line: str, *, families: frozenset[str] | None = None, tables: bool = False) -> Match | None:
        """The entry that explains ``line`` best: the one with the most literal text among
        those whose pattern occurs in the normalised line (``families``: only those).

        An error table's short descriptions (``level == "table"``: cudaGetErrorString's "out
        of memory") are matched only with ``tables``, and then only at the start of the text:
        they are what a wrapper ("CUDA error: <*>") holds, not words to find anywhere."""
        text = normalise(line)
        low = text.lower()
        best: Entry | None = None
        best_m: re.Match[str] | None = None
        for entry in self.candidates(text):
            if (entry.level == "table") is not tables or entry.piece not in low:
                continue
            if families is not None and entry.family not in families:
                continue
            if best is not None and entry.literal <= best.literal:
                continue
            m = entry.regex.match(text) if tables else entry.regex.search(text)
            if m is not None:
                best, best_m = entry, m
        if best is None or best_m is None:
            return None
        return Match(best, _inner(best, best_m, text))

    def table_entry(self, value: str) -> Entry | None:
        """The error table's entry that ``value`` is, exactly (a CUDA error description, a
        signal's name): what a placeholder of another message held."""
        return self._table_text.get(value.strip(" '\"().,:").lower())

    def table_tail(self, line: str) -> Entry | None:
        """An error table's description that a line about CUDA or NCCL gives as its error:
        after a colon or a quote at the end ("CUDA error (kernel.h:188): no kernel image is
        available for execution on the device"), or in parentheses after an error code
        ("CUresult error: 2 (out of memory)"). Whatever printed the line, it reports that
        error of the table."""
        text = normalise(line).rstrip(" .'\"")
        low = text.lower()
        if _CUDA_WORDS.search(low) is None:
            return None
        best: Entry | None = None
        for entry in self._tables:
            piece = entry.pattern.rstrip(" .").lower()
            if len(piece) < 8 or piece not in low:
                continue
            at_end = low.endswith(piece) and low[: len(low) - len(piece)].rstrip().endswith((":", "'", '"'))
            if (at_end or f"({piece})" in low) and (best is None or len(piece) > len(best.pattern)):
                best = entry
        return best

    def matches(self, line: str) -> list[Match]:
        """Every entry (no table's) whose pattern occurs in the normalised line, the most
        literal first: a message built from pieces (a C++ library's) matches several."""
        text = normalise(line)
        low = text.lower()
        found = []
        for entry in self.candidates(text):
            if entry.level == "table" or entry.piece not in low:
                continue
            m = entry.regex.search(text)
            if m is not None:
                whole = entry.head == entry.pattern.strip() or compile_pattern(
                    entry.pattern.rstrip(" .!;:,")).search(text, m.start()) is not None
                found.append(Match(entry, _inner(entry, m, text), m.start(), whole, m.groups()))
        return sorted(found, key=lambda f: (-f.entry.literal, not f.whole, f.entry.pattern))

    def primary(self, found: Sequence[Match]) -> Match | None:
        """Of a line's matches, the message the line itself is: the one that begins first (a
        line opens with its own words; what it quotes comes after), then the most literal, then
        one the line holds whole (not only its opening sentence), then the newest release's."""
        order = {v: i for i, v in enumerate(self.versions)}

        def newest(f: Match) -> int:  # the same words at two levels: the newest release's
            return min((order.get(v, len(order)) for v in f.entry.seen_in), default=len(order))

        return min(found, key=lambda f: (f.start, -f.entry.literal, not f.whole, newest(f), f.entry.pattern),
                   default=None)


def _inner(entry: Entry, m: re.Match[str], text: str) -> str | None:
    """For a wrapper (a pattern ending in ``<*>``: "CUDA error: <*>"), the text its last
    placeholder held: the rest of the line after the whole pattern's literal text."""
    if not entry.wrapper:
        return None
    pattern = entry.pattern.rstrip()[: -len(ANY)]
    whole = compile_pattern(pattern.rstrip()) if pattern.strip() else None
    full = whole.search(text, m.start()) if whole is not None else None
    start = full.end() if full is not None else m.end()
    rest = text[start:].strip(" '\":")
    return rest or None


# --------------------------------------------------------------------------- the data


CATALOGUE_FILE = "catalogue.tsv"
INDEX_FILE = "catalogue.idx"
MODULES_FILE = "modules.tsv"
HEADER = "family\tlevel\tpattern\torigin\tseen_in\tshared"


def _rows(lines: Iterable[str]) -> Iterable[tuple[int, str | list[str]]]:
    """(byte offset, the ``# versions:`` list or a row's columns) of the catalogue file's lines."""
    offset = 0
    for raw in lines:
        at = offset
        offset += len(raw.encode("utf-8"))
        line = raw.rstrip("\n")
        if line.startswith("# versions:"):
            yield at, [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
            continue
        if not line.strip() or line.startswith("#") or line.startswith("family\t"):
            continue
        yield at, line


def _entry(line: str, shared: dict[str, tuple[str, ...]], head: int = -1, literal: int = -1) -> Entry | None:
    """A row's entry; ``head``, ``literal``: its head's length and letters, when the index has them."""
    cols = line.split("\t")
    if len(cols) < 4:
        return None
    seen_text = cols[4] if len(cols) > 4 else ""
    seen = shared.get(seen_text)
    if seen is None:  # 42,000 rows name a few dozen sets of versions: one tuple each
        seen = shared[seen_text] = tuple(sys.intern(v) for v in seen_text.split(",") if v)
    given = "" if literal < 0 else cols[2] if head == len(cols[2]) else cols[2].strip()[:head]  # whole: one string
    return Entry(sys.intern(cols[0]), sys.intern(cols[1]), cols[2], cols[3], seen,
                 sys.intern(cols[5]) if len(cols) > 5 else "", given, literal)


def parse_catalogue(text: str | Iterable[str]) -> Catalogue:
    """The catalogue file's text (or its lines, read as they come): ``# versions: a==1,
    b==2`` comment lines, a header, then ``family  level  pattern  origin  seen_in`` rows
    separated by tabs."""
    entries, versions, _offsets = _parse(text.splitlines(keepends=True) if isinstance(text, str) else text)
    return Catalogue(entries, versions)


def _parse(lines: Iterable[str]) -> tuple[list[Entry], list[str], list[int]]:
    entries: list[Entry] = []
    offsets: list[int] = []
    versions: list[str] = []
    shared: dict[str, tuple[str, ...]] = {}
    for at, row in _rows(lines):
        if isinstance(row, list):
            versions = row
            continue
        entry = _entry(row, shared)
        if entry is not None:
            entries.append(entry)
            offsets.append(at)
    return entries, versions, offsets


class FileRows(Sequence[Entry]):
    """The catalogue file's rows, each read from the file (by its offset) when first asked
    for, kept until the diagnosis that asked ends (``let_go``; ``KEEP`` at most). Kept across
    diagnoses (~620 B a row, up to a thousand a crash), they were the real soak's RSS growth.
    A row is one ``pread`` on a descriptor held open from the index's check on: the file read
    is the one the index was checked against, even after an upgrade replaced it on disk.
    ``heads``: each row's head length and letters, in turn (the index's; empty: worked out)."""

    KEEP = 4096

    def __init__(self, fd: int, offsets: Sequence[int], size: int, heads: Sequence[int] = ()) -> None:
        self._fd, self._size = fd, size
        self._offsets = array("I", offsets)
        self._heads = array("H", heads if len(heads) == 2 * len(offsets) else ())
        self._kept: dict[int, Entry] = {}
        self._shared: dict[str, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self._offsets)

    def let_go(self) -> None:
        """The rows read so far are let go (a diagnosis ended: the next reads its own)."""
        self._kept.clear()

    @overload
    def __getitem__(self, i: int) -> Entry: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Entry]: ...
    def __getitem__(self, i: int | slice) -> Entry | Sequence[Entry]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        entry = self._kept.get(i)
        if entry is None:
            if len(self._kept) >= self.KEEP:
                self._kept.clear()
            start = self._offsets[i]
            end = self._offsets[i + 1] if i + 1 < len(self._offsets) else self._size
            line = os.pread(self._fd, end - start, start).partition(b"\n")[0]
            entry = _entry(line.decode("utf-8"), self._shared, *self._heads[2 * i:2 * i + 2])
            if entry is None:  # the index does not fit the file: cannot happen with a committed pair
                raise IndexError(f"catalogue row {i} at byte {start} is not a row")
            self._kept[i] = entry
        return entry


def index_text(catalogue_text: str) -> str:
    """The word index of a catalogue file's text: ``catalogue.idx``, made with it (``make
    catalogue``) so that the daemon reads rows only when a line's words bring them up."""
    entries, _versions, offsets = _parse(catalogue_text.splitlines(keepends=True))
    index = build_index(entries)
    size = len(catalogue_text.encode("utf-8"))
    out = [f"# the word index of {CATALOGUE_FILE} ({len(entries)} rows, {size} bytes): generated by "
           "scripts/catalogue/harvest.py; do not edit",
           f"size\t{size}", "offsets\t" + ",".join(map(str, offsets)),
           "unindexed\t" + ",".join(map(str, index.unindexed)), "tables\t" + ",".join(map(str, index.tables)),
           "heads\t" + ",".join(f"{len(e.head)},{e.literal}" for e in entries)]
    out += [f"w\t{w}\t" + ",".join(map(str, rows)) for w, rows in index.words()]
    return "\n".join(out) + "\n"


def _numbers(text: str, piece: int = 4096) -> array[int]:
    """A comma-separated list of row numbers, parsed a few KB at a time: split whole, the
    offsets' 42,000 numbers would be 2 MB of short strings at once, and the allocator keeps
    what they took (measured: the index loads in +1.9 MB of RSS so, +2.6 MB split whole)."""
    out = array("I")
    start, end = 0, len(text)
    while start < end:
        cut = text.find(",", start + piece)
        cut = end if cut < 0 else cut
        out.extend(int(x) for x in text[start:cut].split(",") if x)
        start = cut + 1
    return out


def _load_indexed(path: Path, index_file: Path) -> Catalogue | None:
    """The committed catalogue through its index, or None when the index does not fit it.
    The index's word lines (sorted, after its other lines) are read into the index as they
    come: no list of them is held."""
    fd, loaded = os.open(path, os.O_RDONLY | os.O_CLOEXEC), None
    try:
        loaded = _load_index(fd, index_file)
        return loaded
    finally:
        if loaded is None:  # the file the rows are read from is kept open only when it fits
            os.close(fd)


def _load_index(fd: int, index_file: Path) -> Catalogue | None:
    size = os.fstat(fd).st_size
    fields: dict[str, str] = {}
    with index_file.open(encoding="utf-8") as f:
        first_word = ""
        for line in f:
            kind, _, rest = line.rstrip("\n").partition("\t")
            if kind == "w":
                first_word = rest
                break
            if not kind.startswith("#"):
                fields[kind] = rest
        if int(fields.get("size", "-1")) != size:
            return None

        def word_lines() -> Iterator[tuple[str, array[int]]]:
            for text in chain((first_word,), (line.rstrip("\n").partition("\t")[2] for line in f)):
                if text:
                    word, _, listed = text.partition("\t")
                    yield word, _numbers(listed)

        index = Index(word_lines(), _numbers(fields.get("unindexed", "")), _numbers(fields.get("tables", "")))
    offsets = _numbers(fields.get("offsets", ""))
    versions: list[str] = []
    head = os.pread(fd, offsets[0] if offsets else 0, 0).decode("utf-8")  # the lines before the first row
    for line in head.splitlines():
        if line.startswith("# versions:"):
            versions = [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return Catalogue(FileRows(fd, offsets, size, _numbers(fields.get("heads", ""))), versions, index)


def parse_modules(text: str) -> tuple[tuple[str, str], ...]:
    """The module table's text: ``path_prefix  subsystem`` rows (longest prefix first)."""
    rows = [(cols[0], cols[1]) for line in text.splitlines() if line.strip() and not line.startswith("#")
            and len(cols := line.split("\t")) >= 2 and cols[0] != "module"]
    return tuple(sorted(rows, key=lambda r: -len(r[0])))


def let_go_rows() -> None:
    """The loaded catalogue's rows read by a diagnosis let go (none loaded: nothing to do)."""
    if catalogue.cache_info().currsize and isinstance(rows := catalogue().entries, FileRows):
        rows.let_go()


@cache
def catalogue() -> Catalogue:
    """The committed catalogue: through its index, its rows read when a line's words bring
    them up (a few MB, not the 60 of all its entries); read whole only where the index is
    missing or does not fit the file."""
    path, index_file = DATA_DIR / CATALOGUE_FILE, DATA_DIR / INDEX_FILE
    try:
        if path.is_file() and index_file.is_file():
            indexed = _load_indexed(path, index_file)
            if indexed is not None:
                return indexed
        with path.open("r", encoding="utf-8") as f:
            return parse_catalogue(f)
    except (FileNotFoundError, OSError, ValueError):
        return Catalogue(())


@cache
def modules() -> tuple[tuple[str, str], ...]:
    """The committed module table (read once)."""
    return parse_modules(read_text(MODULES_FILE))


_SITE_DIRS = re.compile(r".*/(?:site|dist)-packages/")


def module_path(frame_path: str) -> str:
    """A frame's file as a path inside its package: ``.../site-packages/sglang/srt/x.py`` ->
    ``sglang/srt/x.py``; a source checkout (``/sgl-workspace/sglang/python/sglang/srt/x.py``)
    is cut at the last component that starts a package the table knows."""
    path = frame_path.replace("\\", "/")
    cut = _SITE_DIRS.sub("", path)
    if cut != path:
        return cut
    tops = {prefix.split("/", 1)[0] for prefix, _ in modules()}
    parts = path.split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in tops and i < len(parts) - 1:
            return "/".join(parts[i:])
    return parts[-1]


def subsystem(frame_path: str, table: Sequence[tuple[str, str]] | None = None) -> str | None:
    """The subsystem of the module a frame is in (the longest matching prefix), or None."""
    path = module_path(frame_path)
    for prefix, name in table if table is not None else modules():
        if path.startswith(prefix):
            return name
    return None
