"""``sglang-supervisor logs``: a server's own output (``server.log``), as the daemon wrote it.

``-n N`` prints the last N lines; ``--launch N`` the N-th launch of the file (counted as
``explain --launch N`` counts them: from one of the daemon's ``=== sglang-supervisor
launch`` lines to the next, ``core.diagnosis.launches``); ``-f`` follows the file like
``tail -F``: through relaunches (their markers come by as lines) and through the daemon's
rotation (``server.log`` renamed to ``server.log.1``: the new file is opened from its start).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import IO

from supervisor.cli.common import EXIT_USAGE, fail
from supervisor.core.config import Config, select_server
from supervisor.core.diagnosis.launches import LaunchMarker, LaunchSplitter

FOLLOW_POLL_S = 0.25
CHUNK = 64 * 1024


def log_path(cfg: Config) -> Path:
    return Path(cfg.logging.server_log or Path(cfg.state.dir) / "server.log")


def logs(cfg: Config, *, server: str | None, lines: int, launch: int | None, follow: bool,
         out: IO[str] | None = None, until: float | None = None) -> int:
    """Print a server's log (with several servers, ``server`` names one; the first otherwise).
    ``until``: a monotonic deadline for ``-f`` (tests); None follows until interrupted."""
    out = out or sys.stdout
    unit = select_server(cfg, server)[0]
    path = log_path(unit)
    if not path.exists():
        return fail(f"logs: {path}: no server log yet (has the daemon launched {unit.name} here?)", 1)
    if launch is not None:
        segment, count = launch_lines(path, launch)
        if segment is None:
            return fail(f"logs: {path}: no launch {launch}: the log holds {count} (--launch 1 to {count})", EXIT_USAGE)
        text = segment if lines <= 0 else _last(segment, lines)
        out.write(text)
    else:
        out.write(_tail(path, lines))
    out.flush()
    if follow:
        _follow(path, out, until)
    return 0


def _last(text: str, n: int) -> str:
    kept = text.splitlines(keepends=True)[-n:]
    return "".join(kept)


def _tail(path: Path, n: int) -> str:
    """The last ``n`` lines of ``path`` (read from its end, never the whole file)."""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        data = b""
        while end > 0 and data.count(b"\n") <= n:
            step = min(CHUNK, end)
            end -= step
            f.seek(end)
            data = f.read(step) + data
    text = data.decode("utf-8", errors="replace")
    return "" if n <= 0 else _last(text, n)


def launch_lines(path: Path, number: int) -> tuple[str | None, int]:
    """The ``number``-th launch's lines (1-based, its marker first; None when there is no
    such launch) and how many launches the file holds, split as ``split_launches`` splits a
    text, but read line by line: only the launch being read is held."""
    splitter = LaunchSplitter()
    count, found = 0, None
    current: list[str] | None = None
    marked = False

    def close() -> None:
        nonlocal count, found
        if current is None or (not marked and count == 0 and not "".join(current).strip()):
            return  # only blank lines before the first marker: no launch
        count += 1
        if count == number:
            found = "".join(current)

    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            begins = splitter.feed(line)
            if begins is not False or current is None:
                close()
                current, marked = [], isinstance(begins, LaunchMarker)
            current.append(line)
    close()
    return found, count


def _follow(path: Path, out: IO[str], until: float | None) -> None:
    """``tail -F``: what is appended, and a rotated file's successor from its start."""
    f = path.open("rb")
    f.seek(0, os.SEEK_END)
    inode = os.fstat(f.fileno()).st_ino
    try:
        while until is None or time.monotonic() < until:
            chunk = f.read(CHUNK)
            if chunk:
                out.write(chunk.decode("utf-8", errors="replace"))
                out.flush()
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None
            if st is not None and (st.st_ino != inode or st.st_size < f.tell()):
                f.close()
                f = path.open("rb")  # rotated or truncated: the new file from its start
                inode = os.fstat(f.fileno()).st_ino
                continue
            time.sleep(FOLLOW_POLL_S)
    finally:
        f.close()
