"""The simulated GPU backend, the wait for released memory, and sampling while serving."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.adapters.gpu import GpuInfo, GpuMonitor, GpuProbeError, GpuWatch
from supervisor.adapters.ports import GIB
from supervisor.core.events import GpuLowFree, GpuProbeFailed
from supervisor.services.release import ERRORS_BEFORE_DEGRADED, gpus_released, wait_until_released
from supervisor.sim import simgpu
from supervisor.sim.gpuprobe import SimulatedProbe

Sleeper = Callable[[], subprocess.Popen[bytes]]


@pytest.fixture
def sleeper(no_leftovers: None) -> Iterator[Sleeper]:
    """Starts real ``sleep`` processes to hold simulated memory, and reaps them afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        procs.append(subprocess.Popen(["sleep", "600"]))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=30)


@pytest.fixture
def sim_dir(tmp_path: Path) -> Path:
    """Two simulated 141 GiB GPUs."""
    simgpu.ensure_gpus(tmp_path, 2, 141)
    return tmp_path


def _gpu(index: int, free_gib: float, total_gib: float = 141) -> GpuInfo:
    total = int(total_gib * GIB)
    free = int(free_gib * GIB)
    return GpuInfo(index, f"GPU-{index}", "test", total, free, total - free)


class FakeTime:
    """An injected clock whose sleep advances it: the wait logic without real waiting."""

    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


class ScriptedProbe:
    """A probe that returns (or raises) the given answers in order, repeating the last."""

    def __init__(self, *answers: list[GpuInfo] | GpuProbeError) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def sample(self) -> list[GpuInfo]:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, GpuProbeError):
            raise answer
        return answer

    async def aclose(self) -> None:
        return None


class CountingProbe:
    """Wraps a probe and counts its samples."""

    def __init__(self, inner: SimulatedProbe) -> None:
        self.inner = inner
        self.calls = 0

    async def sample(self) -> list[GpuInfo]:
        self.calls += 1
        return await self.inner.sample()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_live_holder_counts_dead_one_does_not(sim_dir: Path, sleeper: Sleeper) -> None:
    """Memory of a live holder is used; once the holder dies its memory is free again, like a driver context."""
    holder = sleeper()
    simgpu.write_process(sim_dir, holder.pid, {0: 100 * GIB}, title="sglang::scheduler_TP0")
    probe = SimulatedProbe(sim_dir)
    gpu0, gpu1 = await probe.sample()
    assert gpu0.used_bytes == 100 * GIB and gpu0.free_bytes == 41 * GIB
    assert [(p.pid, p.used_bytes) for p in gpu0.processes] == [(holder.pid, 100 * GIB)]
    assert gpu1.free_bytes == gpu1.total_bytes and gpu1.uuid.startswith("GPU-")
    holder.kill()
    holder.wait(timeout=30)
    gpu0, _ = await probe.sample()
    assert gpu0.used_bytes == 0 and gpu0.processes == ()


async def test_stuck_memory_stays_after_its_holder_dies(sim_dir: Path, sleeper: Sleeper) -> None:
    """A stuck allocation stays counted after its process is gone, until a GPU reset."""
    holder = sleeper()
    simgpu.write_process(sim_dir, holder.pid, {1: 90 * GIB}, stuck=True)
    holder.kill()
    holder.wait(timeout=30)
    probe = SimulatedProbe(sim_dir, indices=(1,))
    [gpu1] = await probe.sample()
    assert gpu1.index == 1 and gpu1.used_bytes == 90 * GIB
    simgpu.reset(sim_dir)
    [gpu1] = await probe.sample()
    assert gpu1.used_bytes == 0


async def test_missing_directory_is_an_unavailable_error(tmp_path: Path) -> None:
    """A simulated backend pointed at a directory without gpus.json reports one clear error."""
    with pytest.raises(GpuProbeError, match="has no gpus.json") as info:
        await SimulatedProbe(tmp_path / "nothing").sample()
    assert info.value.unavailable and not info.value.lost


async def test_wait_is_ok_once_the_holder_dies(sim_dir: Path, sleeper: Sleeper) -> None:
    """wait_until_released returns ok as soon as the process holding the GPU has died."""
    holder = sleeper()
    simgpu.write_process(sim_dir, holder.pid, {0: 120 * GIB, 1: 120 * GIB})
    probe = CountingProbe(SimulatedProbe(sim_dir))
    waiting = asyncio.create_task(
        wait_until_released(probe, min_free_share=0.95, timeout_s=60, poll_s=0.05)
    )
    deadline = asyncio.get_running_loop().time() + 30
    while probe.calls < 3:  # it polls against held memory and keeps waiting
        assert asyncio.get_running_loop().time() < deadline and not waiting.done()
        await asyncio.sleep(0.01)
    assert not waiting.done()
    holder.kill()
    await asyncio.to_thread(holder.wait, 30)
    result = await waiting
    assert result.ok and result.error is None
    assert all(g.free_bytes == g.total_bytes for g in result.gpus)


async def test_stuck_memory_is_not_ok_after_the_timeout(sim_dir: Path, sleeper: Sleeper) -> None:
    """Memory that never frees ends the wait at the timeout with ok=False and the per-GPU numbers."""
    holder = sleeper()
    simgpu.write_process(sim_dir, holder.pid, {1: 100 * GIB}, stuck=True)
    holder.kill()
    holder.wait(timeout=30)
    t = FakeTime()
    result = await wait_until_released(
        SimulatedProbe(sim_dir), min_free_share=0.95, timeout_s=120, poll_s=2, clock=t.clock, sleep=t.sleep
    )
    assert not result.ok and result.error is None
    assert result.waited_s == 120
    text = result.describe(0.95)
    assert "needs a GPU reset" in text and "GPU 1 (" in text and "41.0 of 141.0 GiB free (29%)" in text
    assert "GPU 0" not in text  # only the cards still held are named
    stuck = result.stuck_event(120, 0.93)
    assert (stuck.timeout_s, stuck.mem_fraction_static) == (120, 0.93)
    assert [(g["index"], g["free_bytes"]) for g in stuck.gpus] == [(0, 141 * GIB), (1, 41 * GIB)]


async def test_lost_gpu_ends_the_wait_at_once() -> None:
    """A lost GPU is returned immediately as an error: waiting cannot bring it back."""
    t = FakeTime()
    lost = GpuProbeError("nvml: GPU 3: NVMLError_GpuIsLost: GPU is lost", lost=True)
    result = await wait_until_released(
        ScriptedProbe(lost), min_free_share=0.95, timeout_s=120, poll_s=1, clock=t.clock, sleep=t.sleep
    )
    assert not result.ok and result.error is lost and result.waited_s == 0


async def test_transient_probe_error_is_retried() -> None:
    """A transient probe error (a timeout) is retried until a good sample shows free GPUs."""
    t = FakeTime()
    probe = ScriptedProbe(GpuProbeError("nvml: no answer within 5 s"), [_gpu(0, 140)])
    result = await wait_until_released(
        probe, min_free_share=0.95, timeout_s=120, poll_s=1, clock=t.clock, sleep=t.sleep
    )
    assert result.ok and probe.calls == 2 and result.waited_s == 1


async def test_no_gpus_is_released_at_once() -> None:
    """With backend none (no GPUs known) there is nothing to wait for."""
    result = await wait_until_released(ScriptedProbe([]), min_free_share=0.95, timeout_s=5)
    assert result.ok and result.gpus == []


def test_gpus_released_needs_every_card_free_enough() -> None:
    """gpus_released holds only when every card has at least the share free."""
    assert gpus_released([], 0.95)
    assert gpus_released([_gpu(0, 140), _gpu(1, 134)], 0.95)
    assert not gpus_released([_gpu(0, 140), _gpu(1, 41)], 0.95)


def test_low_free_warns_once_per_episode() -> None:
    """A card below the threshold warns once, stays quiet while low, and re-arms only after recovering clearly."""
    watch = GpuWatch(low_free_bytes=GIB)
    names = lambda events: [e.kind for e in events]  # noqa: E731
    assert names(watch.observe([_gpu(0, 5)])) == ["gpu_sample"]
    low = watch.observe([_gpu(0, 0.82)])
    assert names(low) == ["gpu_sample", "gpu_low_free"]
    assert low[1] == GpuLowFree(index=0, uuid="GPU-0", free_bytes=int(0.82 * GIB), threshold_bytes=GIB)
    assert names(watch.observe([_gpu(0, 0.5)])) == ["gpu_sample"]
    assert names(watch.observe([_gpu(0, 1.1)])) == ["gpu_sample"]  # above the threshold, inside the hysteresis
    assert names(watch.observe([_gpu(0, 0.9)])) == ["gpu_sample"]
    assert names(watch.observe([_gpu(0, 3)])) == ["gpu_sample"]  # clearly recovered: re-armed
    assert names(watch.observe([_gpu(0, 0.9)])) == ["gpu_sample", "gpu_low_free"]


def test_probe_errors_report_once_and_recovery_once() -> None:
    """Repeated probe failures give one degraded event; the next good sample gives one recovered event."""
    watch = GpuWatch(low_free_bytes=GIB)
    err = GpuProbeError("nvml: no answer within 5 s")
    first = watch.observe_error(err)
    assert first == [GpuProbeFailed(error=str(err), degraded=True, lost=False)]
    assert watch.observe_error(err) == [] and watch.degraded
    events = watch.observe([_gpu(0, 100)])
    assert GpuProbeFailed(error=None, degraded=False, lost=False) in events
    assert not watch.degraded


async def test_monitor_samples_the_simulated_gpu_while_serving(sim_dir: Path, sleeper: Sleeper) -> None:
    """The monitor samples at its interval and warns once when a rank's free memory falls below the threshold."""
    server = sleeper()
    events: list[tuple[str, dict]] = []
    monitor = GpuMonitor(
        SimulatedProbe(sim_dir), interval_s=0.02, low_free_bytes=GIB,
        emit=lambda e: events.append((e.kind, e.fields())),
    )
    task = asyncio.create_task(monitor.run())
    try:
        simgpu.write_process(sim_dir, server.pid, {0: int(140.2 * GIB), 1: 120 * GIB})
        deadline = asyncio.get_running_loop().time() + 30
        while sum(e == "gpu_sample" for e, _ in events) < 10 or "gpu_low_free" not in {e for e, _ in events}:
            assert asyncio.get_running_loop().time() < deadline, "monitor never warned"
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    warnings = [f for e, f in events if e == "gpu_low_free"]
    assert [w["index"] for w in warnings] == [0]
    assert monitor.last[0].free_bytes < GIB


async def test_wait_until_released_gives_up_waiting_after_errors_in_a_row() -> None:
    """A probe that keeps failing (not lost) ends the wait after a few tries: the daemon then
    runs degraded instead of holding the relaunch for the whole release timeout."""
    from supervisor.adapters import gpu

    class Failing:
        calls = 0

        async def sample(self):
            Failing.calls += 1
            raise gpu.GpuProbeError("simulated GPU: cannot read gpus.json")

        async def aclose(self) -> None:
            return None

    async def no_sleep(_s: float) -> None:
        return None

    result = await wait_until_released(Failing(), min_free_share=0.95, timeout_s=3600, poll_s=1.0, sleep=no_sleep)
    assert not result.ok and result.error is not None
    assert Failing.calls == ERRORS_BEFORE_DEGRADED
