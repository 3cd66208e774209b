"""Reaping the orphans that become ours: as a container's PID 1, or as a child subreaper.

When SGLang's main process dies, a scheduler it leaves behind is reparented to the nearest
ancestor that is a *child subreaper*, else to its PID namespace's init. The daemon sets
itself as a subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so such an orphan becomes the
daemon's child rather than init's: the daemon sees it, can kill it (it is in the server's
tree and session, ``adapters.cleanup``), and must collect its exit. As the entrypoint of a
container the daemon is PID 1, and every orphan of the namespace comes to it, ours or not.

A zombie child is collected with ``waitpid`` on its own pid, never ``waitpid(-1)``: the
server's main process is a child too, and its exit status belongs to its watcher (asyncio's
child watcher, ``adapters.process``); a blanket wait would steal it (asyncio then reports
255). Two rules keep the reaper off other waiters' children:

- ``keep()``: pids never collected here, whatever their age (the daemon's server processes);
- ``settle_s``: any other zombie is collected only once it has stayed a zombie that long.
  A waiter of its own child (a ``subprocess.run`` helper, asyncio's watcher between the
  fork and the moment the daemon knows the server's pid) collects it within milliseconds;
  a zombie nobody collects for half a second is an orphan's.

Finding them: ``/proc/<us>/task/*/children`` where the kernel has it
(``CONFIG_PROC_CHILDREN``), else a scan of ``/proc/*/stat`` for ``ppid`` == us; state ``Z``
means a zombie. ``os.waitid(P_ALL, WNOWAIT)`` would show only one zombie at a time, and
stall on a server zombie its watcher is about to collect.

When: on SIGCHLD (the loop's signal handler: the kernel tells the new parent when a
reparented orphan dies, so an orphan is collected within ``settle_s``), plus a sweep every
``sweep_s`` as a safety net (a SIGCHLD lost when the loop's wake-up pipe was full, a zombie
that outlived a ``keep()`` entry). A periodic sweep alone would leave zombies for up to its
interval and cost a ``/proc`` scan every time, SIGCHLD or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.adapters.ports import ReapedChild, ReaperError

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
PR_GET_CHILD_SUBREAPER = 37
SETTLE_S = 0.5
SWEEP_S = 10.0
PROC = Path("/proc")


def _prctl() -> Callable[..., int]:
    if not sys.platform.startswith("linux"):
        raise ReaperError(f"cannot become a child subreaper: Linux only (this is {sys.platform})")
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError) as exc:
        raise ReaperError(f"cannot become a child subreaper: no prctl in the C library ({exc})") from None


def become_subreaper(on: bool = True) -> None:
    """Make this process a child subreaper (``on=False``: stop being one); ``ReaperError``
    with one line where that cannot be done."""
    prctl = _prctl()
    if prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(int(on)), ctypes.c_ulong(0), ctypes.c_ulong(0),
             ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise ReaperError(f"cannot become a child subreaper: prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def is_subreaper() -> bool:
    """Whether this process is a child subreaper now."""
    prctl = _prctl()
    value = ctypes.c_int(0)
    if prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
             ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise ReaperError(f"prctl(PR_GET_CHILD_SUBREAPER): {os.strerror(err)}")
    return bool(value.value)


@dataclass(frozen=True, slots=True)
class Stat:
    """What ``/proc/PID/stat`` says that the reaper needs."""

    pid: int
    name: str
    state: str
    ppid: int
    start: int  # clock ticks after boot: with the pid, names the process


def parse_stat(text: str) -> Stat | None:
    """``/proc/PID/stat``'s line (the name may hold spaces and parentheses); None if garbled."""
    try:
        head, _, rest = text.rpartition(")")
        pid, _, name = head.partition(" (")
        fields = rest.split()
        return Stat(int(pid), name, fields[0], int(fields[1]), int(fields[19]))
    except (ValueError, IndexError):
        return None


def _read_stat(proc: Path, pid: int) -> Stat | None:
    try:
        return parse_stat((proc / str(pid) / "stat").read_text(errors="replace"))
    except OSError:
        return None  # gone (or reaped) since it was listed


def _child_pids(pid: int, proc: Path) -> Iterable[int]:
    """Our children's pids: the kernel's per-thread lists, else every process's parent."""
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
        lists = [(t / "children").read_text() for t in tasks]
    except FileNotFoundError:
        lists = None  # no CONFIG_PROC_CHILDREN: scan
    except OSError:
        return []
    if lists is not None:
        return [int(c) for text in lists for c in text.split()]
    kids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = _read_stat(proc, int(entry.name))
            if stat is not None and stat.ppid == pid:
                kids.append(stat.pid)
    return kids


def zombie_children(pid: int | None = None, proc: Path = PROC) -> list[Stat]:
    """The zombie children of ``pid`` (default: us), from ``/proc``."""
    pid = os.getpid() if pid is None else pid
    found = []
    for child in _child_pids(pid, proc):
        stat = _read_stat(proc, child)
        if stat is not None and stat.state == "Z" and stat.ppid == pid:
            found.append(stat)
    return found


def reap_one(pid: int, name: str = "") -> ReapedChild | None:
    """Collect zombie child ``pid`` with ``waitpid`` on that pid alone; None when it is not
    ours to collect (already collected by someone else, or still running)."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    return ReapedChild(pid, name, os.waitstatus_to_exitcode(status))


class Reaper:
    """Collects the zombie children that no one else waits for (see the module docstring).

    ``keep()`` is asked at each sweep: the pids whose exit belongs to another waiter.
    ``on_reaped`` gets each sweep's collected children (called on the loop; never raises
    into the reaper). ``start()`` must be called on the running loop, in the main thread.
    """

    def __init__(
        self, keep: Callable[[], Collection[int]], on_reaped: Callable[[Sequence[ReapedChild]], None], *,
        settle_s: float = SETTLE_S, sweep_s: float = SWEEP_S, proc: Path = PROC,
    ) -> None:
        self.keep = keep
        self.on_reaped = on_reaped
        self.settle_s = settle_s
        self.sweep_s = sweep_s
        self.proc = proc
        self.mode = "pid1" if os.getpid() == 1 else "subreaper"
        self.reaped = 0
        self._pid = os.getpid()
        self._seen: dict[tuple[int, int], float] = {}  # (pid, start) -> loop time first seen a zombie
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next: asyncio.TimerHandle | None = None
        self._next_at = float("inf")
        self._periodic: asyncio.TimerHandle | None = None
        self._sigchld = False

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        # Someone else's SIGCHLD handler (an old asyncio child watcher) is left alone: the
        # periodic sweep then does the work.
        if signal.getsignal(signal.SIGCHLD) in (signal.SIG_DFL, None):
            loop.add_signal_handler(signal.SIGCHLD, self._on_sigchld)
            self._sigchld = True
        self._periodic = loop.call_later(self.sweep_s, self._tick)
        self._schedule(0.0)  # zombies from before we started

    def close(self) -> None:
        if self._sigchld and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(signal.SIGCHLD)
        self._sigchld = False
        for handle in (self._next, self._periodic):
            if handle is not None:
                handle.cancel()
        self._next = self._periodic = None
        self._next_at = float("inf")

    def _on_sigchld(self) -> None:
        self._schedule(0.0)

    def _tick(self) -> None:
        assert self._loop is not None
        self._periodic = self._loop.call_later(self.sweep_s, self._tick)
        self.sweep()

    def _schedule(self, delay: float) -> None:
        """One pending sweep, at the earliest time asked for."""
        assert self._loop is not None
        at = self._loop.time() + delay
        if self._next is not None and self._next_at <= at:
            return
        if self._next is not None:
            self._next.cancel()
        self._next_at = at
        self._next = self._loop.call_at(at, self._scheduled)

    def _scheduled(self) -> None:
        self._next = None
        self._next_at = float("inf")
        self.sweep()

    def sweep(self) -> list[ReapedChild]:
        """One look at our zombie children: collect those due, remember the others."""
        loop = self._loop
        now = loop.time() if loop is not None else 0.0
        keep = set(self.keep())
        seen: dict[tuple[int, int], float] = {}
        reaped: list[ReapedChild] = []
        for z in zombie_children(self._pid, self.proc):
            if z.pid in keep:
                continue
            key = (z.pid, z.start)
            first = self._seen.get(key, now)
            if now - first >= self.settle_s:
                done = reap_one(z.pid, z.name)
                if done is not None:
                    reaped.append(done)
                continue
            seen[key] = first
        self._seen = seen
        if seen and loop is not None:
            self._schedule(min(seen.values()) + self.settle_s - now)
        if reaped:
            self.reaped += len(reaped)
            with contextlib.suppress(Exception):
                self.on_reaped(reaped)
        return reaped


def start(keep: Callable[[], Collection[int]], on_reaped: Callable[[Sequence[ReapedChild]], None]) -> Reaper:
    """The daemon's reaper (``Ports.reaper``): become a child subreaper, then reap on the
    running loop. PID 1 is its namespace's reaper already; the prctl is harmless there."""
    become_subreaper()
    reaper = Reaper(keep, on_reaped)
    reaper.start()
    return reaper
