"""When a process started, in a form that no change of the wall clock moves.

psutil's ``create_time()`` is the process's start since boot plus the boot's wall-clock time
as the kernel gives it *at the moment of the call* (``btime`` in /proc/stat). When the clock is
stepped (NTP's first sync, a VM resumed from a snapshot, an operator's ``date -s``) the boot's
wall-clock time moves, and so does every process's ``create_time``: a process noted before
the step reads as another one after it. Compared with a tolerance, that makes a leftover of
ours look like a stranger (not killed) and a live server look gone. A CI run of this project
met it: a foreign server that still answered ``/health`` read as gone, each of its processes
with a create time other than the one noted while it ran.

The kernel's own record of the start (clock ticks since boot, field 22 of /proc/PID/stat)
never moves: two reads of one process give the same integer, and a later process that got
the same pid started at least a tick later. It means nothing across a reboot: the state file
keeps it with the boot's id (``boot_id``).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import psutil


@functools.cache
def boot_id() -> str:
    """This boot's id (the kernel's, new at every boot): a start recorded under another one
    names no process of this boot."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _stat(pid: int) -> list[bytes]:
    """Fields 3.. of /proc/PID/stat (the state first). Raises ``psutil.NoSuchProcess`` when
    the process is gone and ``psutil.AccessDenied`` when /proc hides it, as psutil's own calls
    do, so a caller's ``except psutil.Error`` covers both."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    except PermissionError:
        raise psutil.AccessDenied(pid) from None
    # The name (field 2) is in parentheses and may hold spaces or ")": what follows the last
    # ")" is field 3 on.
    return stat.rsplit(b")", 1)[1].split()


def started(pid: int) -> int:
    """``pid``'s start in clock ticks since boot (field 22); raises as ``_stat`` does."""
    return int(_stat(pid)[19])


def still(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` (not gone, not reused)."""
    try:
        return started(pid) == start
    except psutil.Error:
        return False


def running(pid: int, start: int) -> bool:
    """``still``, and not a zombie: the process that started at ``start`` has not ended (one read)."""
    try:
        fields = _stat(pid)
    except psutil.Error:
        return False
    return int(fields[19]) == start and fields[0] not in (b"Z", b"X")


def age_s(start: int) -> float:
    """How long ago a process of this boot started at ``start`` (ticks since boot), by the
    boot's own clock (``CLOCK_BOOTTIME``, the clock the kernel's start is counted on): no
    step of the wall clock moves it."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start / os.sysconf("SC_CLK_TCK")


def start_or_none(pid: int) -> int | None:
    """``started``, or None when /proc does not show the process."""
    try:
        return started(pid)
    except psutil.Error:
        return None
