"""The simulated GPU: a directory of small JSON files that stands in for NVML.

Layout of a simulated-GPU directory ``D``:

- ``D/gpus.json``: ``{"gpus": [{"index", "uuid", "name", "total_bytes"}, ...]}``.
- ``D/proc-<pid>.json``: one per process holding simulated GPU memory:
  ``{"pid", "started", "title", "stuck", "allocations": [{"gpu", "used_bytes"}]}`` (``started``:
  the process's start in ticks since boot, ``adapters.procstart``; 0 when it was gone).

Memory of a process counts while that process is alive, as on a real GPU where the driver
frees a context when its process dies. ``stuck: true`` keeps it counted after the process
is gone (memory that never frees until a GPU reset). ``reset`` plays the GPU reset.

Written by the simulator, read by the ``simulated`` GPU backend and the tests. Every
write is atomic (temp file + rename), so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid as _uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from supervisor.adapters.procstart import running, started

GIB = 1024**3
GPUS_FILE = "gpus.json"
PROC_PREFIX = "proc-"


@dataclass(frozen=True, slots=True)
class SimProcess:
    pid: int
    title: str
    stuck: bool
    allocations: dict[int, int]  # gpu index -> bytes
    alive: bool


@dataclass(frozen=True, slots=True)
class SimGpu:
    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    processes: tuple[tuple[int, int], ...]  # (pid, used bytes) of live or stuck holders

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)


def _atomic_write_json(path: Path, payload: object) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_gpus(directory: str | os.PathLike[str], count: int, total_gb: float) -> None:
    """Create ``gpus.json`` with ``count`` cards of ``total_gb`` GiB unless it exists."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / GPUS_FILE
    if path.exists():
        return
    gpus = [
        {
            "index": i,
            "uuid": f"GPU-{_uuid.UUID(int=(0x5151 << 112) | i)}",
            "name": f"Simulated GPU {total_gb:g}GB",
            "total_bytes": int(total_gb * GIB),
        }
        for i in range(count)
    ]
    _atomic_write_json(path, {"gpus": gpus})


def write_process(
    directory: str | os.PathLike[str],
    pid: int,
    allocations: dict[int, int],
    *,
    title: str = "",
    stuck: bool = False,
) -> None:
    """Record (or replace) what process ``pid`` holds on each simulated GPU."""
    try:
        start = started(pid)
    except psutil.Error:
        start = 0
    payload = {
        "pid": pid,
        "started": start,
        "title": title,
        "stuck": stuck,
        "allocations": [{"gpu": g, "used_bytes": int(b)} for g, b in sorted(allocations.items())],
    }
    _atomic_write_json(Path(directory) / f"{PROC_PREFIX}{pid}.json", payload)


def remove_process(directory: str | os.PathLike[str], pid: int) -> None:
    (Path(directory) / f"{PROC_PREFIX}{pid}.json").unlink(missing_ok=True)


def _alive(pid: int, start: int) -> bool:
    """Not ended, and not a later process with its pid (without a start: not ended)."""
    if start:
        return running(pid, start)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# What a reader that samples again and again (the ``simulated`` probe, once a second) keeps
# between samples: each file's parsed content by its path, with the identity of the file it
# was read from (every write is a rename: a new inode). A sample reads and parses only the
# files written since the last one, and returns what a fresh read returns.
Reads = dict[str, tuple[tuple[int, int, int], Any]]


def _load(path: str, cache: Reads | None) -> Any:
    """A file's JSON, parsed again only when the file was replaced since ``cache`` read it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        kept = cache.get(path) if cache is not None else None
        if kept is not None and kept[0] == key:
            return kept[1]
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    data = json.loads(b"".join(chunks))
    if cache is not None:
        cache[path] = (key, data)
    return data


def read_processes(directory: str | os.PathLike[str], cache: Reads | None = None) -> list[SimProcess]:
    out: list[SimProcess] = []
    try:
        with os.scandir(directory) as it:
            entries = sorted(e.path for e in it if e.name.startswith(PROC_PREFIX) and e.name.endswith(".json"))
    except OSError:
        return out
    if cache is not None:  # let go of what was read from files now gone
        for gone in cache.keys() - set(entries) - {os.fspath(Path(directory) / GPUS_FILE)}:
            del cache[gone]
    for path in entries:
        try:
            data = _load(path, cache)
            pid = int(data["pid"])
            allocs = {int(a["gpu"]): int(a["used_bytes"]) for a in data.get("allocations", [])}
            alive = _alive(pid, int(data.get("started") or 0))
            out.append(
                SimProcess(pid, str(data.get("title", "")), bool(data.get("stuck")), allocs, alive)
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a file being replaced, or garbage: not a holder
    return out


def read_gpus(directory: str | os.PathLike[str], cache: Reads | None = None) -> list[SimGpu]:
    """The simulated cards with the memory held by live (or stuck) processes."""
    data = _load(os.fspath(Path(directory) / GPUS_FILE), cache)
    holders = [p for p in read_processes(directory, cache) if p.alive or p.stuck]
    gpus: list[SimGpu] = []
    for g in data["gpus"]:
        idx = int(g["index"])
        procs = tuple((p.pid, p.allocations[idx]) for p in holders if idx in p.allocations)
        used = sum(b for _, b in procs)
        gpus.append(
            SimGpu(idx, str(g["uuid"]), str(g.get("name", "")), int(g["total_bytes"]), used, procs)
        )
    return gpus


def reset(directory: str | os.PathLike[str]) -> None:
    """A GPU reset: forget every holder, stuck ones included."""
    for path in Path(directory).glob(f"{PROC_PREFIX}*.json"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
