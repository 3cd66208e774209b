"""The GPU memory ring: fixed size on disk, the least free memory per period, oldest records overwritten."""

from __future__ import annotations

from supervisor.core import events as ev
from supervisor.sinks.gpuring import HEADER, RING, GpuRingSink, capacity_for, read_ring

GB = 1024**3


def sample(*free_gb: float) -> ev.GpuSample:
    return ev.GpuSample(gpus=tuple({"index": i, "uuid": f"GPU-{i}", "total_bytes": 96 * GB,
                                    "free_bytes": int(f * GB), "used_bytes": 0} for i, f in enumerate(free_gb)))


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_one_record_per_period_with_the_least_free_memory(tmp_path):
    """Samples every 10 s into a 60 s ring: a record per minute holding each rank's minimum."""
    clock = Clock()
    sink = GpuRingSink(tmp_path, sample_s=60, keep_days=1, clock=clock)
    for k in range(13):  # 0..120 s
        sink.emit(sample(10.0 - (k % 6), 20.0))
        clock.t += 10
    ring = read_ring(tmp_path)
    assert ring is not None
    assert ring.indices == (0, 1) and ring.total_mib == (96 * 1024, 96 * 1024)
    assert ring.times == (1_000_000.0, 1_000_060.0, 1_000_120.0)
    assert [r[0] for r in ring.free_mib] == [10 * 1024, 5 * 1024, 5 * 1024]  # the least since the last record
    assert ring.capacity == capacity_for(60, 1) == 1440


def test_the_file_has_a_fixed_size_and_the_oldest_records_go(tmp_path):
    """Capacity records, no more: the file never grows, and the newest overwrite the oldest."""
    clock = Clock()
    sink = GpuRingSink(tmp_path, sample_s=1, keep_days=5 / 86400, clock=clock)  # capacity 5
    size = None
    for k in range(12):
        sink.emit(sample(float(k)))
        clock.t += 1
        size = size or (tmp_path / RING).stat().st_size
        assert (tmp_path / RING).stat().st_size == size
    ring = read_ring(tmp_path)
    assert ring is not None and ring.capacity == 5
    assert [r[0] // 1024 for r in ring.free_mib] == [7, 8, 9, 10, 11]
    assert size == HEADER.size + 8 + 5 * 12


def test_a_restarted_daemon_continues_the_ring_and_other_gpus_start_a_new_one(tmp_path):
    clock = Clock()
    GpuRingSink(tmp_path, sample_s=1, keep_days=1, clock=clock).emit(sample(1.0, 2.0))
    clock.t += 5
    GpuRingSink(tmp_path, sample_s=1, keep_days=1, clock=clock).emit(sample(3.0, 4.0))
    ring = read_ring(tmp_path)
    assert ring is not None and len(ring.times) == 2
    assert read_ring(tmp_path, since=clock.t).times == (clock.t,)  # type: ignore[union-attr]
    GpuRingSink(tmp_path, sample_s=1, keep_days=1, clock=clock).emit(sample(5.0))
    ring = read_ring(tmp_path)
    assert ring is not None and ring.indices == (0,) and len(ring.times) == 1


def test_errors_never_raise(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("x")
    errors: list[str] = []
    sink = GpuRingSink(blocked / "state", on_error=errors.append)
    sink.emit(sample(1.0))
    sink.emit(sample(1.0))
    assert sink.errors == 2 and len(errors) == 1
    assert read_ring(tmp_path) is None
