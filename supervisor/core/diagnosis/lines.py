"""Line shapes (log prefixes, exception lines, frames) and the unmangling of pasted logs:
the text itself, before any rule reads it."""

from __future__ import annotations

import re
from array import array
from itertools import repeat

from supervisor.core.diagnosis.limits import MAX_LINE_CHARS, MAX_LINES, MAX_TAIL_BYTES

# --------------------------------------------------------------------------- line shapes

_PREFIX = re.compile(
    r"[\s|`'\">]+"  # indentation, CI-view "  | ", quotes, markdown backticks
    r"|(?:#033|\x1b)\[[0-9;]{0,20}m"  # ANSI colour, raw or syslog-escaped
    r"|\[[^\]\n]{0,100}\]:?"  # "[2025-08-02 19:24:30 TP3]", "[rank0]:"
    r"|\([\w.-]{1,60}(?:,? \w{1,20}=[\w.:-]{1,60}){0,4}\)"  # "(WorkerDict pid=1)", "(VllmWorker rank=7 pid=2)"
    r"|[\w.-]{1,40} {1,8}\|"  # docker compose "sglang-1  |"
    r"|\d{4}-\d\d-\d\d[T ][\d:.,]{5,20}Z?"  # "2025-04-06T07:44:23.51Z", "2024-12-19 21:40:35"
    r"|(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)(?: \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,6})?)?"
    r"(?: \d{1,10})? \[?[\w.-]{1,60}:\d{1,6}\]"  # vLLM "ERROR 03-23 21:43:38 [worker.py:620]"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):"  # uvicorn "ERROR:    "
    r"|(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)(?= \d{4}-\d\d-\d\d)"  # a log viewer's "ERROR 2025-04-05T00:01:19Z"
    r"|kernel:"
)
_EXC = re.compile(r"([A-Za-z_]\w{0,100}(?:\.[A-Za-z_]\w{0,100}){0,8})(?::(?: (.*))?$|\((.*)$|$)")
_EXC_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt", "Failure", "Fault")
_FRAME = re.compile(r'File "([^"\n]{1,500})", line (\d{1,7}), in ([\w<>.-]{1,200})')
_TRACEBACK = "traceback (most recent call last)"
_DIGITS = re.compile(r"\d+")
_CARETS = re.compile(r"[\^~\s]+")  # the markers under a source line (Python >= 3.11)
# An exception message that continues on the next lines (NCCL names the CUDA failure there).
_DETAILS_FOLLOW = ("unhandled cuda error", "unhandled system error", "nccl_debug=info for details", "last error:")


def _strip_prefix(line: str) -> str:
    """The line without log prefixes (timestamps, ranks, pids, levels, docker columns)."""
    pos = 0
    for _ in range(16):
        m = _PREFIX.match(line, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
    return line[pos:]


def _prefix_shape(line: str) -> str:
    """The line's log prefix with digits blurred: equal for lines of one log record."""
    prefix = line[: len(line) - len(_strip_prefix(line))].strip()
    return _DIGITS.sub("0", prefix)


def _parse_exception(line: str) -> tuple[str, str] | None:
    """``(type, message)`` when the line is a Python exception line, else None."""
    body = _strip_prefix(line).rstrip()
    m = _EXC.match(body)
    if m is None:
        return None
    name = m.group(1)
    last = name.rsplit(".", 1)[-1]
    if not last.endswith(_EXC_SUFFIXES):
        return None
    if m.end(1) == len(body) and last in _EXC_SUFFIXES:
        return None  # a bare "Error" is a word, not an exception's name
    # vLLM's repr form: OutOfMemoryError('CUDA out of memory...')
    repr_form = m.group(3)
    message = repr_form.rstrip(")").strip("'\"") if repr_form is not None else (m.group(2) or "").strip()
    return name, message


# --------------------------------------------------------------------------- the tail, unmangled


def tail_text(tail: bytes | str, limit: int = MAX_TAIL_BYTES) -> str:
    """The last ``limit`` bytes (characters for str) as text, starting at a whole line."""
    if isinstance(tail, bytes | bytearray | memoryview):
        raw = bytes(tail[-limit:]) if len(tail) > limit else bytes(tail)
        cut = len(tail) > limit
        text = raw.decode("utf-8", errors="replace")
    else:
        cut = len(tail) > limit
        text = tail[-limit:] if cut else tail
    if cut:
        first_newline = text.find("\n")
        if 0 <= first_newline < len(text) - 1:
            text = text[first_newline + 1 :]
    return text


# Where a line that had other lines joined onto it is cut again: before a traceback header,
# a frame line, a timestamped record or an exception line.
_JOIN_POINT = re.compile(
    r"(?<=\S) {1,8}(?=Traceback \(most recent call last\)|File \"[^\"\n]{1,300}\", line \d"
    r"|\[\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d|(?:[A-Za-z_]\w{0,60}\.){0,6}[A-Z]\w{0,60}(?:Error|Exception): )"
)
_JOINED_LINE_CHARS = 600  # only lines longer than this are looked at for joins


def _is_blank(line: str) -> bool:
    """Empty once its log prefix (quote marks, timestamp, rank, docker column) is gone."""
    bare = line.strip(" >\t\r")
    return not bare or (len(line) < 120 and not _strip_prefix(line).strip())


def _unmangle(parts: list[str]) -> tuple[list[str], array[int] | None]:
    """The lines of a log pasted with a blank line after every line, or with lines joined,
    back as the server printed them; and each new line's index in ``parts`` (None: same)."""
    blank = [_is_blank(line) for line in parts]
    nonblank = array("l", (i for i, b in enumerate(blank) if not b))  # one buffer, not an int per line
    doubled = len(nonblank) >= 4 and sum(
        1 for i in nonblank if i + 1 < len(parts) and blank[i + 1]
    ) >= 0.8 * len(nonblank)
    long_lines = any(len(line) > _JOINED_LINE_CHARS for line in parts)
    if not doubled and not long_lines:
        return parts, None
    lines: list[str] = []
    orig = array("l")
    for i in nonblank if doubled else range(len(parts)):
        line = parts[i]
        pieces = [line]
        if len(line) > _JOINED_LINE_CHARS:
            cuts = [m.end() for m in _JOIN_POINT.finditer(line, 0, 64 * MAX_LINE_CHARS)][:200]
            # Never between a line's own log prefix and its message ("... [executor.py:383] torch.XError: ...").
            cuts = [c for k, c in enumerate(cuts) if _strip_prefix(line[(cuts[k - 1] if k else 0):c]).strip()]
            if cuts:
                pieces = [line[a:b] for a, b in zip([0, *cuts], [*cuts, len(line)], strict=True)]
        lines.extend(pieces)
        orig.extend(repeat(i, len(pieces)))
    return lines, orig


_ISO_STAMP = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?")


def _newest_first(parts: list[str]) -> bool:
    """A log pasted from a viewer that lists the newest line first: its timestamps go down,
    or its tracebacks' headers come after their frames ("Traceback (most recent call last)"
    is always followed by its first frame when written)."""
    down = up = 0  # consecutive timestamps that go down, and up (counted as read: no list of them)
    last = None
    for line in parts[:4000]:
        if (m := _ISO_STAMP.search(line[:120])) is None:
            continue
        stamp = m.group(0).replace(" ", "T").replace(",", ".")
        if last is not None:
            down, up = down + (last > stamp), up + (last < stamp)
        last = stamp
    if down >= 5 and down >= 4 * up:
        return True
    before = after = 0
    for i, line in enumerate(parts[:MAX_LINES]):
        if _TRACEBACK not in line.lower():
            continue
        near_before = any(_FRAME.search(parts[j]) for j in range(max(0, i - 2), i))
        near_after = any(_FRAME.search(parts[j]) for j in range(i + 1, min(len(parts), i + 3)))
        before += near_before and not near_after
        after += near_after
    return before > after
