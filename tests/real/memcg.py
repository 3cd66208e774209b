"""A memory cgroup of the test's own, for a real kernel OOM kill (cgroup v1 or v2, as root).

``MemoryCgroup.create()`` makes a child of this process's own memory cgroup; ``enter_argv``
is a wrapper that moves a command into it before exec'ing it (the daemon, and so its
server, run inside); ``squeeze`` sets the limit just above what the group uses now;
``hog`` starts a process inside that allocates until the kernel's OOM killer acts.
Nothing here is the product's: the daemon only reads the count the kernel keeps.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_ENTER = "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); os.execvp(sys.argv[2], sys.argv[2:])"
# The hog keeps out of the OOM killer's choice, and at the kernel's first kill it stops and
# lets its memory go: while the victim's memory is torn down the group sits at its limit, and
# any allocation in it (SGLang's main, its detokenizer, the daemon) would make a second victim,
# whose pidfd can fire before the bigger scheduler's. That makes a second kill rarer; the
# kernel does not promise it away, so the test asserts nothing on which death comes first.
_HOG = (
    "import os, sys, time\n"
    "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
    "open('/proc/self/oom_score_adj', 'w').write('-1000')\n"
    "def kills():\n"
    "    for line in open(sys.argv[2]).read().splitlines():\n"
    "        if line.startswith('oom_kill '): return int(line.split()[1])\n"
    "    return 0\n"
    "first, b = kills(), []\n"
    "while kills() == first:\n    b.append(bytearray(8 << 20)); time.sleep(0.005)\n"
    "b.clear()\n"
    "time.sleep(3600)"
)


class CgroupUnavailable(RuntimeError):
    """No writable memory cgroup here (not root, or no memory controller)."""


@dataclass
class MemoryCgroup:
    path: Path
    v2: bool

    @classmethod
    def create(cls) -> MemoryCgroup:
        text = Path("/proc/self/cgroup").read_text()
        name = f"sglang-supervisor-test-{uuid.uuid4().hex[:8]}"
        errors = []
        for line in text.splitlines():
            hierarchy, _, rest = line.partition(":")
            controllers, _, cgroup = rest.partition(":")
            if "memory" in controllers.split(","):
                base, v2 = ROOT / "memory" / cgroup.strip().lstrip("/"), False
            elif hierarchy == "0" and controllers == "" and (ROOT / "cgroup.controllers").exists():
                base, v2 = ROOT / cgroup.strip().lstrip("/"), True
            else:
                continue
            try:
                path = base / name
                path.mkdir()
                group = cls(path, v2)
                group._write(group._limit_file, str(16 << 30))
                return group
            except OSError as exc:
                errors.append(f"{base}: {exc}")
                with contextlib.suppress(OSError):
                    (base / name).rmdir()
        raise CgroupUnavailable("; ".join(errors) or f"no memory cgroup in /proc/self/cgroup: {text!r}")

    @property
    def _limit_file(self) -> str:
        return "memory.max" if self.v2 else "memory.limit_in_bytes"

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def usage(self) -> int:
        return int((self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")).read_text())

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        raise AssertionError(f"no oom_kill in {self.path / name}")

    def enter_argv(self) -> list[str]:
        """A prefix that runs the rest of an argv inside this cgroup."""
        return [sys.executable, "-c", _ENTER, str(self.path / "cgroup.procs")]

    def squeeze(self, headroom: int = 64 << 20) -> None:
        self._write(self._limit_file, str(self.usage() + headroom))

    def release(self) -> None:
        self._write(self._limit_file, "max" if self.v2 else str(16 << 30))

    def hog(self) -> subprocess.Popen[bytes]:
        events = self.path / ("memory.events" if self.v2 else "memory.oom_control")
        return subprocess.Popen([sys.executable, "-c", _HOG, str(self.path / "cgroup.procs"), str(events)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def remove(self, timeout: float = 30.0) -> None:
        """Kill what is left inside and remove the group."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            self.path.rmdir()
