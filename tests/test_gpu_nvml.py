"""The NVML backend against a fake pynvml (tests/fake_pynvml.py) and the real one without a driver."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from collections.abc import Iterator

import fake_pynvml
import pytest

from supervisor.config import GpuConfig
from supervisor.gpu import (
    GIB,
    GpuMonitor,
    GpuProbeError,
    NoneProbe,
    NvmlProbe,
    SimulatedProbe,
    make_probe,
    parse_visible_devices,
)

UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[fake_pynvml.FakeState]:
    """The fake module as ``pynvml`` with two 141 GiB cards; GPU 1 holds an orphan."""
    state = fake_pynvml.reset([
        fake_pynvml.FakeDevice(UUID0, total=141 * GIB, used=GIB // 2),
        fake_pynvml.FakeDevice(UUID1, total=141 * GIB, used=100 * GIB, processes=[(4242, 100 * GIB)]),
    ])
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)
    yield state
    fake_pynvml.STATE.release.set()


def test_fake_has_the_real_module_names() -> None:
    """Every public name the fake defines exists in the real nvidia-ml-py, with the same error codes."""
    real = importlib.import_module("pynvml")
    assert real is not fake_pynvml
    names = [n for n in vars(fake_pynvml) if n.startswith(("nvml", "NVML"))]
    assert "NVMLError_GpuIsLost" in names and "nvmlDeviceGetComputeRunningProcesses" in names
    missing = [n for n in names if not hasattr(real, n)]
    assert missing == []
    for n in names:
        if n.startswith("NVML_ERROR_"):
            assert getattr(fake_pynvml, n) == getattr(real, n), n
    assert type(real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)).__name__ == "NVMLError_GpuIsLost"
    assert type(fake_pynvml.NVMLError(fake_pynvml.NVML_ERROR_GPU_IS_LOST)).__name__ == "NVMLError_GpuIsLost"
    assert "version" in inspect.signature(real.nvmlDeviceGetMemoryInfo).parameters


async def test_samples_every_gpu_with_processes(nvml: fake_pynvml.FakeState) -> None:
    """With no indices and no CUDA_VISIBLE_DEVICES the probe reads every card, lazily initialising NVML."""
    probe = NvmlProbe((), 1.0, environ={})
    assert nvml.calls == []
    gpus = await probe.sample()
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].uuid == UUID0 and gpus[0].name == "NVIDIA H200"
    assert gpus[0].free_bytes == 141 * GIB - GIB // 2 and gpus[0].processes == ()
    assert [(p.pid, p.used_bytes) for p in gpus[1].processes] == [(4242, 100 * GIB)]
    await probe.sample()
    assert nvml.calls.count("nvmlInit") == 1
    await probe.aclose()
    assert not nvml.initialized


async def test_used_gpu_memory_none_and_unknown_pids(nvml: fake_pynvml.FakeState) -> None:
    """A process with no per-process figure and a pid from another pid namespace are reported as is."""
    nvml.devices[0].processes = [(4_000_000, None)]
    gpus = await NvmlProbe((0,), 1.0).sample()
    assert len(gpus) == 1
    assert [(p.pid, p.used_bytes) for p in gpus[0].processes] == [(4_000_000, None)]


async def test_configured_indices_win_over_cuda_visible_devices(nvml: fake_pynvml.FakeState) -> None:
    """Configured indices are used even when CUDA_VISIBLE_DEVICES says otherwise."""
    gpus = await NvmlProbe((1,), 1.0, environ={"CUDA_VISIBLE_DEVICES": "0"}).sample()
    assert [g.index for g in gpus] == [1]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [("1", [1]), ("1,0", [1, 0]), (UUID1, [1]), ("GPU-aaaaaaaa", [1]), ("", [])],
)
async def test_cuda_visible_devices_selects_gpus(
    nvml: fake_pynvml.FakeState, visible: str, expected: list[int]
) -> None:
    """CUDA_VISIBLE_DEVICES picks the cards by index, full uuid or uuid prefix; empty means none."""
    gpus = await NvmlProbe((), 1.0, environ={"CUDA_VISIBLE_DEVICES": visible}).sample()
    assert [g.index for g in gpus] == expected


async def test_cuda_visible_devices_naming_a_missing_gpu_is_an_error(nvml: fake_pynvml.FakeState) -> None:
    """A CUDA_VISIBLE_DEVICES entry that matches no card is one clear error, not a crash."""
    with pytest.raises(GpuProbeError, match="CUDA_VISIBLE_DEVICES entry 'GPU-ffff' matches no GPU"):
        await NvmlProbe((), 1.0, environ={"CUDA_VISIBLE_DEVICES": "GPU-ffff"}).sample()


def test_parse_visible_devices_stops_at_the_first_invalid_entry() -> None:
    """Like CUDA, entries after an invalid one are ignored; unset means all GPUs."""
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("0, 2,-1,3") == [0, 2]
    assert parse_visible_devices("MIG-abc,1") == ["MIG-abc", 1]


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 not found"),
        (fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
    ],
)
async def test_init_failure_is_an_unavailable_error(
    nvml: fake_pynvml.FakeState, code: int, words: str
) -> None:
    """A missing library or driver is one line, marked unavailable and not lost; init is retried next time."""
    nvml.errors["nvmlInit"] = code
    probe = NvmlProbe((), 1.0, environ={})
    with pytest.raises(GpuProbeError) as info:
        await probe.sample()
    assert info.value.unavailable and not info.value.lost
    assert words in str(info.value) and "\n" not in str(info.value)
    del nvml.errors["nvmlInit"]
    assert len(await probe.sample()) == 2


async def test_gpu_is_lost_is_marked_lost(nvml: fake_pynvml.FakeState) -> None:
    """NVMLError_GpuIsLost from a device query yields GpuProbeError(lost=True) naming the card."""
    nvml.errors["nvmlDeviceGetMemoryInfo"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuProbeError) as info:
        await NvmlProbe((1,), 1.0).sample()
    assert info.value.lost
    assert "GPU 1" in str(info.value) and "fallen off the bus" in str(info.value)


async def test_unknown_error_is_neither_lost_nor_unavailable(nvml: fake_pynvml.FakeState) -> None:
    """NVMLError_Unknown is a transient probe error: retried, not a give-up."""
    nvml.errors["nvmlDeviceGetCount"] = fake_pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(GpuProbeError) as info:
        await NvmlProbe((), 1.0, environ={}).sample()
    assert not info.value.lost and not info.value.unavailable
    assert "NVMLError_Unknown" in str(info.value)


async def test_unsupported_process_query_gives_no_processes(nvml: fake_pynvml.FakeState) -> None:
    """A card that cannot list its processes (NotSupported) still reports its memory."""
    nvml.errors["nvmlDeviceGetComputeRunningProcesses"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    gpus = await NvmlProbe((1,), 1.0).sample()
    assert gpus[0].processes == () and gpus[0].used_bytes == 100 * GIB


async def test_uninitialized_error_reinitialises(nvml: fake_pynvml.FakeState) -> None:
    """If NVML was shut down behind the probe's back, the next sample initialises it again."""
    probe = NvmlProbe((0,), 1.0)
    await probe.sample()
    nvml.initialized = False
    with pytest.raises(GpuProbeError, match="Uninitialized"):
        await probe.sample()
    assert len(await probe.sample()) == 1
    assert nvml.calls.count("nvmlInit") == 2


async def test_hung_call_times_out_without_blocking_the_loop(nvml: fake_pynvml.FakeState) -> None:
    """A call stuck in the driver becomes a GpuProbeError after call_timeout_s while the loop keeps running."""
    nvml.hang.add("nvmlDeviceGetMemoryInfo")
    probe = NvmlProbe((0,), 0.3)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    try:
        with pytest.raises(GpuProbeError, match="no answer within 0.3 s"):
            await probe.sample()
        assert ticks > 1
        with pytest.raises(GpuProbeError, match="has not returned"):
            await probe.sample()  # fails fast: no second thread piles up behind the stuck one
        assert nvml.calls.count("nvmlDeviceGetMemoryInfo") == 1
    finally:
        task.cancel()
    nvml.hang.clear()
    nvml.release.set()
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            assert len(await probe.sample()) == 1
            break
        except GpuProbeError:
            assert asyncio.get_running_loop().time() < deadline, "probe never recovered"
            await asyncio.sleep(0.05)


async def test_missing_pynvml_package_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the nvidia-ml-py package the probe says so in one line instead of crashing."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuProbeError, match="nvidia-ml-py package") as info:
        await NvmlProbe((), 1.0, environ={}).sample()
    assert info.value.unavailable


async def test_real_pynvml_without_a_driver_degrades() -> None:
    """The real nvidia-ml-py on a host without libnvidia-ml gives LibraryNotFound as an unavailable error."""
    probe = NvmlProbe((), 5.0, environ={})
    try:
        gpus = await probe.sample()
    except GpuProbeError as exc:
        assert exc.unavailable and "NVMLError_LibraryNotFound" in str(exc)
    else:  # a machine with a driver: then the readings must be sane
        assert all(0 <= g.free_bytes <= g.total_bytes for g in gpus)
    await probe.aclose()


async def test_monitor_reports_a_lost_gpu_once(nvml: fake_pynvml.FakeState) -> None:
    """While serving, a lost GPU emits one gpu_probe_error(lost) and calls on_lost once, however often it is sampled."""
    events: list[tuple[str, dict]] = []
    lost: list[GpuProbeError] = []
    monitor = GpuMonitor(
        NvmlProbe((0,), 1.0), interval_s=1.0, low_free_bytes=GIB,
        emit=lambda e, f: events.append((e, dict(f))), on_lost=lost.append,
    )
    await monitor.tick()
    nvml.errors["nvmlDeviceGetMemoryInfo"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    await monitor.tick()
    await monitor.tick()
    assert [e for e, _ in events] == ["gpu_sample", "gpu_probe_error"]
    assert events[1][1]["lost"] is True and events[1][1]["degraded"] is True
    assert len(lost) == 1 and monitor.watch.degraded


def test_make_probe_picks_the_configured_backend(tmp_path) -> None:
    """make_probe maps [gpu] backend to the probe class."""
    assert isinstance(make_probe(GpuConfig(backend="nvml")), NvmlProbe)
    assert isinstance(make_probe(GpuConfig(backend="simulated", sim_dir=str(tmp_path))), SimulatedProbe)
    assert isinstance(make_probe(GpuConfig()), NoneProbe)
