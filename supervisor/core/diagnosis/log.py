"""The log: a tail split into lines, searched by substring, with the facts around a line
(its traceback, its exception, its rank, the nearest progress line)."""

from __future__ import annotations

from array import array
from bisect import bisect_right

from supervisor.core.diagnosis.limits import (
    _AFTER_WINDOW,
    _BACK_WINDOW,
    KEPT_SERVING_BATCHES,
    MAX_CANDIDATES,
    MAX_LINE_CHARS,
    MAX_LINES,
)
from supervisor.core.diagnosis.lines import (
    _CARETS,
    _DETAILS_FOLLOW,
    _FRAME,
    _TRACEBACK,
    _newest_first,
    _parse_exception,
    _prefix_shape,
    _strip_prefix,
    _unmangle,
)
from supervisor.core.diagnosis.markers import _BATCH_LINES, _REPORT_LINES, _SERVING_PROGRESS, _STARTUP_PROGRESS
from supervisor.core.diagnosis.startup_facts import line_rank
from supervisor.core.model import Phase


def _line_starts(text: str) -> array[int]:
    """The offset of each line of ``text`` and, last, one past its end (+1 for the newline
    it would end with): line ``i`` is ``text[starts[i] : starts[i + 1] - 1]``."""
    starts = array("q", [0])
    find, pos = text.find, text.find("\n")
    while pos != -1:
        starts.append(pos + 1)
        pos = find("\n", pos + 1)
    starts.append(len(text) + 1)
    return starts


class _Log:
    """A log tail split into lines, with substring search over its lowered text.

    The crash is searched for only after the last line that proves the server outlived
    everything before it: the last ``ready to roll``, or the batch line that has
    ``KEPT_SERVING_BATCHES - 1`` more after it. In a long serving log that is a short
    stretch at the end, so the rule needles scan little text.
    """

    def __init__(self, text: str, lines_after_ready: int | None = None) -> None:
        parts = text.replace("\r\n", "\n").rsplit("\n", MAX_LINES)
        self.skipped = 0  # lines dropped from the front (beyond MAX_LINES)
        if len(parts) > MAX_LINES:
            self.skipped = parts[0].count("\n") + 1
            parts = parts[1:]
        # The first line (an index into parts) logged after the daemon saw the server ready.
        ready_part = None if lines_after_ready is None else max(0, len(parts) - 1 - lines_after_ready)
        parts, self._orig = _unmangle(parts)
        if _newest_first(parts):
            # A log viewer that shows the newest line first: read it in the order it was written.
            orig = self._orig if self._orig is not None else array("l", range(len(parts)))
            parts, self._orig = parts[::-1], orig[::-1]
            if ready_part is not None:
                ready_part = None  # the daemon never hands over such a log; a file's offset means nothing here
        self._lines = parts
        self._low_text = "\n".join(parts).lower()  # lower() never makes or takes a newline
        # Where each lowered line starts, in one array: no second list of line objects (the
        # heap a diagnosis leaves is its peak's; issue 36).
        self._starts = _line_starts(self._low_text)
        self.count = len(parts)
        ready = self.last_line(("ready to roll",), self.count)
        outlived = self.nth_last_line(_BATCH_LINES, KEPT_SERVING_BATCHES)
        self.crash_start = max(ready, outlived) + 1  # where the crash can begin
        self.ready_index: int | None  # the first line logged after the server was last ready
        if ready_part is not None:  # the daemon's own READY (a group node >= 1 logs no ready line)
            self.ready_index = next((i for i in range(self.count) if self._part(i) >= ready_part), self.count)
            self.crash_start = max(self.crash_start, self.ready_index)
        else:
            self.ready_index = ready + 1 if ready >= 0 else None
        self.first_sigquit = self.first_line(("received sigquit", "sigquit received"), self.crash_start)

    def _part(self, i: int) -> int:
        """The index in the text's own lines of line ``i`` (they differ once unmangled)."""
        return self._orig[i] if self._orig is not None else i

    def lineno(self, i: int) -> int:
        """1-based line number of line ``i`` in the text given."""
        return (self._orig[i] if self._orig is not None else i) + 1 + self.skipped

    def text(self, i: int) -> str:
        return self._lines[i][:MAX_LINE_CHARS].rstrip("\r")

    def low(self, i: int) -> str:
        start = self._starts[i]
        return self._low_text[start : min(self._starts[i + 1] - 1, start + MAX_LINE_CHARS)]

    def _line_of(self, pos: int) -> int:
        return bisect_right(self._starts, pos) - 1

    def find_needles(self, needles: tuple[str, ...], start: int = 0, last: int = MAX_CANDIDATES) -> dict[int, set[str]]:
        """The needles each line from ``start`` on holds, for the ``last`` last lines per needle."""
        hits: dict[int, set[str]] = {}
        low, starts = self._low_text, self._starts
        for needle in needles:
            end, found = len(low), 0
            while found < last and (pos := low.rfind(needle, starts[start], end)) != -1:
                i = self._line_of(pos)
                hits.setdefault(i, set()).add(needle)
                found += 1
                end = starts[i]
        return hits

    def find_lines(self, needles: tuple[str, ...], start: int = 0, last: int = MAX_CANDIDATES) -> list[int]:
        """Sorted indices of the ``last`` last lines from ``start`` on that hold any needle."""
        return sorted(self.find_needles(needles, start, last))[-last:]

    def first_line(self, needles: tuple[str, ...], start: int = 0) -> int | None:
        found = [self._line_of(p) for n in needles if (p := self._low_text.find(n, self._starts[start])) != -1]
        return min(found) if found else None

    def last_line(self, needles: tuple[str, ...], before: int) -> int:
        """Index of the last line before ``before`` holding a needle, or -1."""
        end = self._starts[before]
        found = [self._line_of(p) for n in needles if (p := self._low_text.rfind(n, 0, end)) != -1]
        return max(found, default=-1)

    def nth_last_line(self, needles: tuple[str, ...], n: int) -> int:
        """Index of the ``n``-th last line holding a needle, or -1 when there are fewer."""
        found: set[int] = set()
        for needle in needles:
            end = len(self._low_text)
            while len(found) < 2 * n and (pos := self._low_text.rfind(needle, 0, end)) != -1:
                line = self._line_of(pos)
                found.add(line)
                end = self._starts[line]
        ordered = sorted(found, reverse=True)
        return ordered[n - 1] if len(ordered) >= n else -1

    # -- line kinds

    def is_frame(self, i: int) -> bool:
        return 0 <= i < self.count and 'file "' in self.low(i) and _FRAME.search(self.text(i)) is not None

    def is_code(self, i: int) -> bool:
        """A source line that a traceback shows under a frame line (or a bare ``raise``)."""
        if _strip_prefix(self.text(i)).startswith(("raise ", "return ", "assert ")):
            return True
        return self.is_frame(i - 1) and not self.is_frame(i) and _parse_exception(self.text(i)) is None

    def exception(self, i: int) -> tuple[str, str] | None:
        low = self.low(i)
        if "rror" not in low and "xception" not in low and "exit" not in low and "interrupt" not in low \
                and "failure" not in low and "fault" not in low:
            return None
        return _parse_exception(self.text(i))

    def traceback_lines(self, index: int) -> list[int]:
        """Indices of the traceback right above ``index`` (innermost first), up to its header."""
        found = []
        for i in range(index - 1, max(-1, index - 1 - _BACK_WINDOW), -1):
            if _TRACEBACK in self.low(i):
                found.append(i)
                break
            if not (self.is_frame(i) or self.is_code(i) or _CARETS.fullmatch(_strip_prefix(self.text(i)))
                    or self._continued_source(i)):
                break  # not part of a traceback
            found.append(i)
        return found

    def _continued_source(self, i: int) -> bool:
        """An indented line of a multi-line source statement that a traceback shows."""
        text = self.text(i)
        body = _strip_prefix(text)
        return bool(body) and text[: len(text) - len(body)].endswith("    ") and self.exception(i) is None

    def logical(self, i: int) -> tuple[str, int]:
        """Line ``i`` plus, for an exception whose message is on the next lines, those lines."""
        text = self.text(i)
        exc = self.exception(i)
        dangling = exc is not None and not exc[1]
        if not dangling and (exc is None or not any(k in self.low(i) for k in _DETAILS_FOLLOW)):
            return text, i
        end, shape = i, _prefix_shape(text)
        for j in range(i + 1, min(self.count, i + 7)):
            if not self.text(j).strip() or self.is_frame(j) or _TRACEBACK in self.low(j):
                break
            if (dangling and self.exception(j)) or _prefix_shape(self.text(j)) != shape:
                break  # the next exception, or another log record
            end = j
        return " ".join(self.text(k) for k in range(i, end + 1)), end

    # -- facts around a line

    def nearest_progress(self, i: int) -> tuple[tuple[Phase, str | None], str] | None:
        """The phase (and startup stage) the last progress line before ``i`` shows, and its marker."""
        last_startup = self.last_line(tuple(_STARTUP_PROGRESS), i)
        last_serving = self.last_line(_SERVING_PROGRESS, i)
        if last_startup < 0 and last_serving < 0:
            return None
        if last_serving > last_startup:
            low = self.low(last_serving)
            return (Phase.SERVING, None), next((k for k in _SERVING_PROGRESS if k in low), "serving")
        low = self.low(last_startup)
        key, stage = next(((k, st) for k, st in _STARTUP_PROGRESS.items() if k in low), ("start-up", None))
        return (Phase.STARTING, stage), key

    def progress_anywhere(self) -> tuple[tuple[Phase, str | None], str] | None:
        """The phase progress lines anywhere in the log show: serving lines mean serving;
        start-up markers with no ready line mean start-up (the server never became ready)."""
        serving = self.last_line(_SERVING_PROGRESS, self.count)
        if serving >= 0:
            low = self.low(serving)
            return (Phase.SERVING, None), next((k for k in _SERVING_PROGRESS if k in low), "serving")
        startup = self.last_line(tuple(_STARTUP_PROGRESS), self.count)
        if startup < 0:
            return None
        low = self.low(startup)
        key, stage = next(((k, st) for k, st in _STARTUP_PROGRESS.items() if k in low), ("start-up", None))
        return (Phase.STARTING, stage), key

    def report_lines(self, index: int, end: int) -> list[int]:
        """The failure report around an error: its traceback, itself, what follows."""
        lines = [*self.traceback_lines(index), *range(index, end + 1)]
        for j in range(end + 1, min(self.count, end + 1 + _AFTER_WINDOW)):
            low = self.low(j)
            if self.is_frame(j) or self.is_code(j) or any(k in low for k in _REPORT_LINES):
                lines.append(j)
        return lines

    def rank_near(self, index: int) -> str | None:
        rank = line_rank(self.text(index))
        if rank:
            return rank
        for i in self.traceback_lines(index):
            rank = line_rank(self.text(i))
            if rank:
                return rank
        return None

    def location(self, index: int) -> str | None:
        """The innermost frame above ``index`` outside torch's own code (else the innermost)."""
        first = None
        for i in self.traceback_lines(index):
            m = _FRAME.search(self.text(i))
            if m is None:
                continue
            path, lineno, func = m.groups()
            name = path.replace("\\", "/").rsplit("/", 1)[-1]
            where = f"{name}:{lineno} {func}"
            if "/torch/" not in path and not path.startswith("torch/"):
                return where
            first = first or where
        return first

    def exception_near(self, index: int) -> tuple[str, str, int] | None:
        """The exception line ``index`` is (or continues): type, message, its line index."""
        exc = self.exception(index)
        if exc is not None:
            return exc[0], exc[1], index
        for i in range(index - 1, max(-1, index - 7), -1):
            if self.is_frame(i) or not self.text(i).strip():
                return None
            exc = self.exception(i)
            if exc is not None:
                return (exc[0], exc[1], i) if not exc[1] else None
        return None
