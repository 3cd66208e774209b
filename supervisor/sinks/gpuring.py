"""Free GPU memory per rank over the last days: a fixed-size binary ring in the state directory.

Fed by the ``gpu_sample`` events the GPU monitor already emits (no NVML call of its own).
Every ``[report] gpu_sample_s`` it writes one record: the wall time and, for each GPU, the
*least* free memory seen since the previous record (how close to the edge it came, not a
lucky instant). ``keep_days`` decide the capacity; the newest record overwrites the oldest.

The file, ``STATE_DIR/gpu_ring.bin``, little-endian::

    header   (64 bytes)  magic "SGSGPU01", version u16, ranks u16, record size u32,
                         capacity u32, padding u32, written u64 (records ever written),
                         sample_s f64, created f64, 16 bytes reserved
    rank table           ranks x (GPU index u32, total MiB u32)
    records              capacity x (wall time f64, ranks x free MiB u32)

Why this format: it is bounded by construction (its size is fixed when it is created: 10,080
records of 8 ranks is 403 KB for 7 days at one a minute), so there is no rotation, no
compaction and no growth to watch; a record is one ``pwrite`` of 40 bytes at a computed
offset plus the 8-byte ``written`` counter (written after the record, so a torn record is
never counted), no parsing and no allocation in the daemon; and the reader is ``struct``
from the standard library. A JSON-lines file would need rotation and ten times the bytes;
SQLite would add its import, its journal and its fsyncs to a daemon that must stay cheap.
A daemon restarted with the same GPUs and capacity appends to the ring it finds; otherwise
the ring is created anew.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.core.events import Event, GpuSample

RING = "gpu_ring.bin"
MAGIC = b"SGSGPU01"
VERSION = 1
HEADER = struct.Struct("<8sHHIIIQdd16x")  # 64 bytes
WRITTEN_AT = 24  # the offset of ``written`` in the header
RANK = struct.Struct("<II")
MAX_CAPACITY = 2_000_000
MIB = 1024 * 1024


def capacity_for(sample_s: float, keep_days: float) -> int:
    """Records needed to keep ``keep_days`` at one per ``sample_s`` (capped)."""
    return max(2, min(MAX_CAPACITY, math.ceil(keep_days * 86400 / sample_s)))


@dataclass(frozen=True, slots=True)
class Ring:
    """A ring read back: the GPUs, their totals, and the records oldest first."""

    indices: tuple[int, ...]
    total_mib: tuple[int, ...]
    sample_s: float
    capacity: int
    times: tuple[float, ...]
    free_mib: tuple[tuple[int, ...], ...]  # per record, per rank


def _record_struct(ranks: int) -> struct.Struct:
    return struct.Struct(f"<d{ranks}I")


def _data_offset(ranks: int) -> int:
    return HEADER.size + RANK.size * ranks


def read_ring(state_dir: str | os.PathLike[str], since: float | None = None) -> Ring | None:
    """The ring in ``state_dir`` (records from ``since`` on), or None if there is none or it
    is not a ring."""
    path = Path(state_dir) / RING
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < HEADER.size:
        return None
    magic, version, ranks, rec_size, capacity, _pad, written, sample_s, _created = HEADER.unpack_from(data)
    rec = _record_struct(ranks)
    if magic != MAGIC or version != VERSION or rec.size != rec_size or capacity <= 0:
        return None
    table = [RANK.unpack_from(data, HEADER.size + i * RANK.size) for i in range(ranks)]
    base = _data_offset(ranks)
    count = min(written, capacity)
    times: list[float] = []
    free: list[tuple[int, ...]] = []
    for n in range(written - count, written):
        off = base + (n % capacity) * rec_size
        if off + rec_size > len(data):
            continue
        t, *values = rec.unpack_from(data, off)
        if t <= 0 or (since is not None and t < since):
            continue
        times.append(t)
        free.append(tuple(values))
    return Ring(tuple(i for i, _ in table), tuple(m for _, m in table), sample_s, capacity, tuple(times), tuple(free))


class GpuRingSink:
    """EventSink keeping the least free memory of each GPU per ``sample_s`` in the ring."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        sample_s: float = 60.0,
        keep_days: float = 7.0,
        clock: Callable[[], float] = time.time,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.path = Path(state_dir) / RING
        self.sample_s = sample_s
        self.capacity = capacity_for(sample_s, keep_days)
        self._clock = clock
        self._on_error = on_error
        self._fd: int | None = None
        self._indices: tuple[int, ...] = ()
        self._written = 0
        self._last_t: float | None = None
        self._least: dict[int, int] = {}  # index -> least free bytes since the last record
        self._failing = False
        self.errors = 0

    def emit(self, event: Event) -> None:
        """Fold a ``gpu_sample`` into the current period; write a record when it is over."""
        if not isinstance(event, GpuSample):
            return
        try:
            self._sample(event.gpus, self._clock())
            self._failing = False
        except Exception as exc:  # noqa: BLE001 - a sink must never raise into supervision
            self.errors += 1
            self.close()
            if not self._failing:
                self._failing = True
                if self._on_error is not None:
                    with contextlib.suppress(Exception):
                        self._on_error(f"{self.path}: {exc!r}"[:300])

    def _sample(self, gpus: Sequence[Mapping[str, object]], now: float) -> None:
        readings = {int(g["index"]): g for g in gpus if isinstance(g.get("index"), int)}  # type: ignore[call-overload]
        if not readings:
            return
        indices = tuple(sorted(readings))
        if self._fd is None or indices != self._indices:
            self._open(indices, readings)
            self._least = {}
            self._last_t = None
        for i, g in readings.items():
            free = g.get("free_bytes")
            if isinstance(free, int):
                self._least[i] = min(free, self._least.get(i, free))
        if self._last_t is not None and now - self._last_t < self.sample_s:
            return
        self._write(now)

    def _write(self, now: float) -> None:
        assert self._fd is not None
        ranks = len(self._indices)
        rec = _record_struct(ranks)
        values = [min(self._least.get(i, 0) // MIB, 0xFFFFFFFF) for i in self._indices]
        slot = self._written % self.capacity
        os.pwrite(self._fd, rec.pack(now, *values), _data_offset(ranks) + slot * rec.size)
        self._written += 1
        os.pwrite(self._fd, struct.pack("<Q", self._written), WRITTEN_AT)  # after the record: never a torn one
        self._last_t = now
        self._least = {}

    def _open(self, indices: tuple[int, ...], readings: Mapping[int, Mapping[str, object]]) -> None:
        """Continue the ring on disk if it is ours with these GPUs and this capacity, else make one."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        ranks = len(indices)
        rec = _record_struct(ranks)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            head = os.pread(fd, HEADER.size + RANK.size * ranks, 0)
            if len(head) == HEADER.size + RANK.size * ranks:
                magic, version, n, rec_size, capacity, _pad, written, sample_s, _c = HEADER.unpack_from(head)
                table = tuple(RANK.unpack_from(head, HEADER.size + k * RANK.size)[0] for k in range(ranks))
                if (magic, version, n, rec_size, capacity, sample_s, table) == (
                        MAGIC, VERSION, ranks, rec.size, self.capacity, self.sample_s, indices):
                    self._fd, self._indices, self._written = fd, indices, written
                    return
            totals = []
            for i in indices:
                total = readings[i].get("total_bytes")
                totals.append(min(total // MIB, 0xFFFFFFFF) if isinstance(total, int) else 0)
            os.ftruncate(fd, 0)
            os.ftruncate(fd, _data_offset(ranks) + self.capacity * rec.size)  # sparse until written
            header = HEADER.pack(MAGIC, VERSION, ranks, rec.size, self.capacity, 0, 0, self.sample_s, self._clock())
            table_bytes = b"".join(RANK.pack(i, t) for i, t in zip(indices, totals, strict=True))
            os.pwrite(fd, header + table_bytes, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._indices, self._written = fd, indices, 0

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
