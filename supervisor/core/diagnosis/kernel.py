"""OOM-killer records: the kernel's lines for the server's pids, the cgroup's ``oom_kill`` count."""

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
