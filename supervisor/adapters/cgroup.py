"""The OOM killer's record in the service's own memory cgroup (an adapter: it reads files).

A SIGKILLed scheduler is a host OOM only with a record of it. Under the hardened unit the
kernel log is out of reach (``ProtectKernelLogs=yes``), but the service's own cgroup files
are readable and the server runs in that cgroup: the daemon reads the ``oom_kill`` count
when it launches a server and after the server died (``Ports.oom_kills``).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from supervisor.core.diagnosis import read_oom_kill_count


def cgroup_oom_kills(path: str | None = None) -> int | None:
    """The OOM killer's count for this process's own memory cgroup (or the file at ``path``).

    Under the hardened unit the kernel log is out of reach (ProtectKernelLogs=yes) but the
    service's own cgroup files are readable, and the server runs in that cgroup: a rise of
    this count while it ran is the OOM killer's record. cgroup v2 keeps it in
    ``memory.events``, v1 (and hybrid hosts) in ``memory.oom_control``; both say
    ``oom_kill N``. None when nothing can be read."""
    if path is not None:
        candidates = [path]
    else:
        try:
            candidates = oom_kill_files(Path("/proc/self/cgroup").read_text())
        except OSError:
            return None
    for candidate in candidates:
        try:
            count = read_oom_kill_count(Path(candidate).read_text())
        except OSError:
            continue
        if count is not None:
            return count
    return None


def oom_kill_files(proc_self_cgroup: str, root: str = "/sys/fs/cgroup") -> list[str]:
    """Where a process's memory cgroup keeps its ``oom_kill`` count, from its
    ``/proc/self/cgroup`` text (pure): the v2 path (plain or under ``unified`` on hybrid
    hosts) and the v1 memory controller's."""
    files: list[str] = []
    for line in proc_self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, cgroup = rest.partition(":")
        if not cgroup:
            continue
        cgroup = cgroup.strip()
        if hierarchy == "0" and controllers == "":
            files += [_join(root, cgroup, "memory.events"), _join(root, "unified", cgroup, "memory.events")]
        elif "memory" in controllers.split(","):
            files.append(_join(root, "memory", cgroup, "memory.oom_control"))
    return files


def _join(root: str, *parts: str) -> str:
    return str(PurePosixPath(root).joinpath(*(p.strip("/") for p in parts if p.strip("/"))))
