"""The messages the serving stack can print, harvested from its own code (issue 23).

``scripts/catalogue/harvest.py`` (``make catalogue``) reads pinned releases of SGLang, torch
(its Python and the strings of its shared libraries), NCCL, the CUDA runtime, Triton,
FlashInfer, sgl-kernel, vLLM, transformers, safetensors, huggingface_hub, uvicorn and
asyncio, and writes every message it finds as a normalised pattern with its origin and a
**family** to ``supervisor/core/data/catalogue.tsv``; the module trees of the same releases
become ``supervisor/core/data/modules.tsv`` (a module path -> the subsystem it belongs to).
Nothing here is typed by hand from logs: the words come from the code that prints them.

This module is pure: it reads its two data files (package data, once, on first use) and
matches log lines against them. ``normalise`` is the one normaliser: the harvester applies
it to the literal text of each message, the diagnosis to each log line, so a number, a
path, a size or an id is the same placeholder on both sides.

A pattern is literal text with placeholders: ``<*>`` where the source formats a value (an
f-string expression, ``%s``, ``{}``), and the normaliser's own tokens (``<n>``, ``<size>``,
``<path>``, ``<hex>``, ``<id>``) where the source's literal holds one. A line matches a
pattern when the pattern occurs in the normalised line, each ``<*>`` standing for any short
run of text (case is ignored).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

ANY = "<*>"
ANY_CHARS = 240  # what one <*> may stand for in a line
MIN_LITERAL_CHARS = 12  # an entry's literal letters; fewer say too little to match on

# --------------------------------------------------------------------------- normalising

_NORMALISERS: tuple[tuple[re.Pattern[str], str], ...] = (
    # ids first: a uuid, a long hex digest or a hex address would otherwise become numbers
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), "<id>"),
    (re.compile(r"\b0x[0-9a-fA-F]{1,32}\b"), "<hex>"),
    (re.compile(r"\b(?=[0-9a-f]{0,63}[a-f])(?=[0-9a-f]{0,63}\d)[0-9a-f]{16,64}\b"), "<hex>"),
    # paths: two or more components (a file name alone stays: "scheduler.py" is a word)
    (re.compile(r"(?:[A-Za-z]:)?(?:[~.]{0,2}/[\w.@+=:-]{1,200}){2,40}/?"), "<path>"),
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
    return sum(c.isalpha() for c in _PLACEHOLDER.sub("", pattern))


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
    # What a line must hold: the pattern's first sentences, enough of them to say something
    # (``HEAD_LETTERS``), without the closing punctuation (see ``head_of``).
    head: str = field(init=False, repr=False, compare=False)
    literal: int = field(init=False, repr=False, compare=False)  # letters of the head outside placeholders
    # The head's longest literal piece, lowercased: a line without it cannot match (checked before the regex).
    piece: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        head = head_of(self.pattern)
        head = self.pattern if head == self.pattern else head  # one string, not two equal ones
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "literal", literal_chars(head))
        object.__setattr__(self, "piece", sys.intern(max(head.lower().split(ANY), key=len)))

    @property
    def regex(self) -> re.Pattern[str]:
        """The head's regex, compiled when first needed (most entries never are)."""
        return compile_pattern(self.head)

    @property
    def wrapper(self) -> bool:
        """The message ends in what it wraps ("CUDA error: <*>", "... set an error? Error <*>:
        <*>"): the diagnosis reads that."""
        return self.pattern.rstrip().endswith(ANY)

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
    text = pattern.strip()
    for cut in _HEAD_CUTS.finditer(text):
        head = text[: cut.start()].rstrip(" .!;:,(")
        if literal_chars(head) >= HEAD_LETTERS and len(_HEAD_WORD.findall(_PLACEHOLDER.sub(" ", head))) >= HEAD_WORDS:
            return head
    return text.rstrip(" .!;:,") or text


HEAD_WORDS = 3  # and three words: "Special token <*>" says nothing yet
_HEAD_WORD = re.compile(r"[A-Za-z]{2,}")
_HEAD_CUTS = re.compile(r"(?=<\*>)|(?<=[.!?;])\s+(?=\S)|$")


@cache
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


class Catalogue:
    """Entries indexed by one rare word each, so a line is checked against few regexes."""

    def __init__(self, entries: Iterable[Entry], versions: Sequence[str] = ()) -> None:
        self.entries = tuple(entries)
        self.versions = tuple(versions)
        frequency: dict[str, int] = {}
        words = [_words(e.head) for e in self.entries]  # a line must hold the head: index by its words
        for ws in words:
            for w in ws:
                frequency[w] = frequency.get(w, 0) + 1
        self._by_word: dict[str, list[Entry]] = {}
        self._unindexed: list[Entry] = []
        self._tables = [e for e in self.entries if e.level == "table"]
        self._table_text = {e.pattern.strip(" .").lower(): e for e in reversed(self._tables)}
        for entry, ws in zip(self.entries, words, strict=True):
            if not ws:
                self._unindexed.append(entry)
                continue
            key = min(ws, key=lambda w: (frequency[w], -len(w), w))
            self._by_word.setdefault(key, []).append(entry)

    def __len__(self) -> int:
        return len(self.entries)

    def candidates(self, normalised: str) -> list[Entry]:
        found: list[Entry] = list(self._unindexed)
        for w in _words(normalised):
            found.extend(self._by_word.get(w, ()))
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


DATA = "data"
CATALOGUE_FILE = "catalogue.tsv"
MODULES_FILE = "modules.tsv"


def parse_catalogue(text: str | Iterable[str]) -> Catalogue:
    """The catalogue file's text (or its lines, read as they come: the file is megabytes and
    the daemon stays light): ``# versions: a==1, b==2`` comment lines, a header, then
    ``family  level  pattern  origin  seen_in`` rows separated by tabs."""
    entries = []
    versions: list[str] = []
    header_seen = False
    shared: dict[str, tuple[str, ...]] = {}  # 42,000 rows name a few dozen sets of versions: one tuple each
    for line in text.splitlines() if isinstance(text, str) else text:
        line = line.rstrip("\n")
        if line.startswith("#"):
            if line.startswith("# versions:"):
                versions = [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
            continue
        if not line.strip():
            continue
        cols = line.split("\t")
        if not header_seen:
            header_seen = True
            if cols[0] == "family":
                continue
        if len(cols) < 4:
            continue
        seen = shared.setdefault(cols[4] if len(cols) > 4 else "", tuple(
            sys.intern(s) for s in (cols[4].split(",") if len(cols) > 4 else ()) if s))
        entries.append(Entry(sys.intern(cols[0]), sys.intern(cols[1]), cols[2], cols[3], seen))
    return Catalogue(entries, versions)


def parse_modules(text: str) -> tuple[tuple[str, str], ...]:
    """The module table's text: ``path_prefix  subsystem`` rows (longest prefix first)."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        cols = line.split("\t")
        if len(cols) >= 2 and cols[0] != "module":
            rows.append((cols[0], cols[1]))
    return tuple(sorted(rows, key=lambda r: -len(r[0])))


def _read(name: str) -> str:
    try:
        return resources.files("supervisor.core").joinpath(DATA, name).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        return ""


@cache
def catalogue() -> Catalogue:
    """The committed catalogue (read once, line by line)."""
    try:
        with resources.files("supervisor.core").joinpath(DATA, CATALOGUE_FILE).open("r", encoding="utf-8") as f:
            return parse_catalogue(f)
    except (FileNotFoundError, OSError):
        return Catalogue(())


@cache
def modules() -> tuple[tuple[str, str], ...]:
    """The committed module table (read once)."""
    return parse_modules(_read(MODULES_FILE))


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
