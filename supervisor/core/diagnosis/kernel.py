"""Kernel records: the OOM killer's lines for the server's pids, the cgroup's ``oom_kill``
count, and (``record_in``) the kernel's own records pasted into a log: the OOM killer's
(Linux ``mm/oom_kill.c``: "Out of memory: Killed process", "oom-kill:", "invoked oom-killer")
and the NVIDIA driver's Xid lines for the codes that mean the hardware or its links failed."""

from __future__ import annotations

import re
from collections.abc import Collection

from supervisor.core.diagnosis.limits import MAX_EVIDENCE_CHARS, MAX_LINE_CHARS
from supervisor.core.diagnosis.lines import tail_text

_KERNEL_KILL = re.compile(r"Kill(?:ed)? process (\d{1,10})|oom-kill:[^\n]{0,400}?\bpid=(\d{1,10})", re.IGNORECASE)


def kernel_oom_line(kernel_log: str | None, pids: Collection[int]) -> str | None:
    """The first kernel OOM-killer line that names one of ``pids``."""
    if not kernel_log or not pids:
        return None
    wanted = {int(p) for p in pids}
    for line in tail_text(kernel_log).splitlines():
        low = line.lower()
        if "out of memory" not in low and "oom" not in low:
            continue
        for m in _KERNEL_KILL.finditer(line[:MAX_LINE_CHARS]):
            if int(m.group(1) or m.group(2)) in wanted:
                return line.strip()[:MAX_EVIDENCE_CHARS]
    return None


_OOM_KILL_LINE = re.compile(r"^oom_kill (\d{1,18})\s*$", re.MULTILINE)


def read_oom_kill_count(memory_events_text: str) -> int | None:
    """The ``oom_kill`` count of a cgroup v2 ``memory.events`` file's text, or None.

    ``memory.events`` holds ``low``, ``high``, ``max``, ``oom``, ``oom_kill`` and
    ``oom_group_kill`` lines of ``name count``; ``oom_kill`` counts the processes the
    kernel's OOM killer killed in the cgroup. None when the text has no such line.
    """
    if not isinstance(memory_events_text, str):
        return None
    m = _OOM_KILL_LINE.search(memory_events_text)
    return int(m.group(1)) if m else None


# Xid codes that mean the hardware or its links failed (NVIDIA's Xid table: ECC, fell off the
# bus, NVLink/fabric, GSP). 13, 31, 43, 45 are faults of the application and are not counted.
HW_XIDS = frozenset(
    {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 140, 144, 145, 146, 147, 148, 149, 150, 154}
)
_XID = re.compile(r"\bXid\b(?: \([^)\n]{0,40}\))?(?: error)?:? ?(\d{1,3})\b|previous Xid (\d{1,3})\b", re.IGNORECASE)
_OOM_RECORD = re.compile(r"out of memory: kill(?:ed)? process|\boom-kill:|invoked oom-killer", re.IGNORECASE)


def record_in(line: str) -> tuple[str, str] | None:
    """The kernel record a log line is, if any: ("oom", the record) for the OOM killer's, ("xid",
    "Xid N") for the NVIDIA driver's report of a hardware failure."""
    text = line[:MAX_LINE_CHARS]
    if _OOM_RECORD.search(text):
        return "oom", "the kernel's OOM killer"
    if "xid" in text.lower():
        for m in _XID.finditer(text):
            code = m.group(1) or m.group(2)
            if code and int(code) in HW_XIDS:
                return "xid", f"NVIDIA driver Xid {code}"
    return None
