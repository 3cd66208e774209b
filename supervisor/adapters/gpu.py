"""GPU probe: per-GPU memory and the compute processes on each card.

Three backends, chosen by ``[gpu] backend``:

- ``nvml``: the NVIDIA driver through ``nvidia-ml-py`` (imported as ``pynvml``). Every
  NVML call runs in a worker thread, bounded by ``call_timeout_s``; ``nvmlInit`` is lazy
  and retried after a failure, so a host whose driver comes up late recovers by itself.
- ``simulated``: the simulator's per-rank memory files (``supervisor.sim.simgpu.SimulatedProbe``),
  passed in by the CLI's registry: this module never imports the simulator.
- ``none``: no GPU knowledge at all (``sample`` returns ``[]``).

Every failure surfaces as one ``GpuProbeError`` with a one-line ``str``: ``lost`` marks a
GPU that has fallen off the bus (cause ``gpu_hw_error``: a restart cannot fix it), and
``unavailable`` marks a host where NVML cannot work at all (no library, no driver, no
package): the daemon runs degraded instead of crashing.

Also here: the pure helpers that decide whether memory has been released
(``gpus_released``), the wait for it (``wait_until_released``), and ``GpuWatch``/
``GpuMonitor``, which sample while serving and warn once per low-memory episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import queue
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from supervisor.adapters.ports import GpuInfo, GpuProbe, GpuProbeError, GpuProcess, NoneProbe
from supervisor.aio import within
from supervisor.core.config import GpuConfig
from supervisor.core.events import Event, GpuLowFree, GpuProbeFailed, GpuSample

T = TypeVar("T")


class BoundedWorker:
    """Runs one blocking call at a time in a daemon thread, bounded by a timeout.

    Not ``asyncio.to_thread``: the default executor's threads are joined at interpreter
    exit and shared with everything else, so one NVML call stuck in the driver would hang
    the daemon's shutdown and, repeated every interval, eat the pool. Here a call that
    overruns is abandoned (its thread is a daemon thread) and later calls fail fast until
    it returns, so at most one thread is ever stuck.

    One thread serves every call, started at the first and asleep on its queue between
    them, not a thread started per call (one a second per GPU monitor). It ends when the
    worker is let go.
    """

    def __init__(self, what: str, timeout_s: float) -> None:
        self._what = what
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._pending: asyncio.Future[Any] | None = None
        self._pending_since = 0.0
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] | None = None

    def _submit(self, job: Callable[[], None]) -> None:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_run_jobs, args=(self._jobs,), name=f"{self._what}-call", daemon=True).start()
            weakref.finalize(self, self._jobs.put, None)  # the thread holds the queue, not the worker
        self._jobs.put(job)

    async def call(self, fn: Callable[[], T]) -> T:
        async with self._lock:
            loop = asyncio.get_running_loop()
            if self._pending is not None and not self._pending.done():
                raise GpuProbeError(
                    f"{self._what}: an earlier call has not returned for "
                    f"{loop.time() - self._pending_since:.0f} s (stuck in the driver?)"
                )
            fut: asyncio.Future[T] = loop.create_future()
            fut.add_done_callback(_consume_exception)

            def settle(ok: bool, value: Any) -> None:
                if fut.done():
                    return
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

            def work() -> None:
                try:
                    result: tuple[bool, Any] = (True, fn())
                except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    result = (False, exc)
                with contextlib.suppress(RuntimeError):  # the loop closed while the call was stuck: nobody waits
                    loop.call_soon_threadsafe(settle, *result)

            self._pending, self._pending_since = fut, loop.time()
            self._submit(work)
            try:
                return await within(asyncio.shield(fut), self._timeout_s)
            except TimeoutError:
                raise GpuProbeError(
                    f"{self._what}: no answer within {self._timeout_s:g} s"
                ) from None


def _run_jobs(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    """A worker's thread: its calls in order, until it is let go (None)."""
    while (job := jobs.get()) is not None:
        job()


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    # An abandoned (timed-out) call may end in an exception nobody awaits: mark it read.
    if not fut.cancelled():
        fut.exception()


# --------------------------------------------------------------------------- backends


# NVML error class name -> hint for the one log line. Class names as pynvml generates them.
_NVML_HINTS = {
    "NVMLError_LibraryNotFound": "libnvidia-ml.so.1 not found: no NVIDIA driver on this host, "
    "or it is not mounted into the container",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
    "NVMLError_NoPermission": "no permission to query the GPU",
    "NVMLError_LibRmVersionMismatch": "NVML library and kernel driver versions differ "
    "(driver upgraded without a reboot?)",
    "NVMLError_GpuIsLost": "the GPU has fallen off the bus: it needs a GPU reset or a reboot",
    "NVMLError_ResetRequired": "the GPU needs a reset",
    "NVMLError_Timeout": "NVML timed out",
}
# Nothing will change by waiting: the daemon runs degraded.
_NVML_UNAVAILABLE = {"NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded",
                     "NVMLError_LibRmVersionMismatch", "NVMLError_NoPermission"}
# The card itself is gone: a human must reset it (cause gpu_hw_error).
_NVML_LOST = {"NVMLError_GpuIsLost", "NVMLError_ResetRequired"}
# Per-device queries that some GPUs/drivers (MIG, vGPU) do not support: not an error.
_NVML_OPTIONAL = {"NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission"}


def _nvml_error(exc: BaseException, where: str) -> GpuProbeError:
    kind = type(exc).__name__
    text = str(exc)
    lost = kind in _NVML_LOST or "fallen off the bus" in text.lower()
    hint = _NVML_HINTS.get(kind, "")
    message = f"nvml: {where}: {kind}: {text}" + (f" ({hint})" if hint else "")
    return GpuProbeError(message, lost=lost, unavailable=kind in _NVML_UNAVAILABLE)


def parse_visible_devices(value: str | None) -> list[int | str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: indices and/or (prefixes of) GPU/MIG uuids.

    ``None`` when unset (all GPUs); ``[]`` when set but empty or starting with an invalid
    entry. Like CUDA, entries after the first invalid one are ignored.
    """
    if value is None:
        return None
    out: list[int | str] = []
    for token in (t.strip() for t in value.split(",")):
        if token.isdigit():
            out.append(int(token))
        elif token.startswith(("GPU-", "MIG-")):
            out.append(token)
        else:
            break  # "", "-1", "NoDevFiles": CUDA stops reading here
    return out


class NvmlProbe:
    """``backend = "nvml"``: the NVIDIA driver through ``pynvml``.

    The GPUs are the configured NVML ``indices``, else ``CUDA_VISIBLE_DEVICES`` (integers
    are taken as NVML indices, which match CUDA's only with CUDA_DEVICE_ORDER=PCI_BUS_ID;
    uuids are exact), else all. A whole sample is one worker-thread call bounded by
    ``call_timeout_s``.
    """

    def __init__(
        self,
        indices: Sequence[int] = (),
        call_timeout_s: float = 5.0,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._indices = tuple(indices)
        env = os.environ if environ is None else environ
        self._visible = None if self._indices else parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
        self._worker = BoundedWorker("nvml", call_timeout_s)
        self._nvml: Any = None  # the pynvml module once nvmlInit succeeded

    async def sample(self) -> list[GpuInfo]:
        return await self._worker.call(self._sample)

    async def aclose(self) -> None:
        if self._nvml is None:
            return
        with contextlib.suppress(GpuProbeError):  # closing: a driver that cannot shut down is not worth a log line
            await self._worker.call(self._shutdown)

    # ---- everything below runs in the worker thread

    def _shutdown(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            with contextlib.suppress(Exception):  # best effort at close
                nvml.nvmlShutdown()

    def _init(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            raise GpuProbeError(
                "nvml: the nvidia-ml-py package (pynvml) is not installed", unavailable=True
            ) from None
        try:
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError and friends, mapped below
            raise _nvml_error(exc, "nvmlInit") from None
        self._nvml = nvml
        return nvml

    def _sample(self) -> list[GpuInfo]:
        nvml = self._init()
        try:
            return [self._read(nvml, index, handle) for index, handle in self._handles(nvml)]
        except GpuProbeError:
            raise
        except Exception as exc:  # noqa: BLE001 - NVMLError and friends, mapped below
            if type(exc).__name__ == "NVMLError_Uninitialized":
                self._nvml = None  # someone shut NVML down: init again next time
            raise _nvml_error(exc, "sample") from None

    def _handles(self, nvml: Any) -> list[tuple[int, Any]]:
        if self._indices:
            return [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in self._indices]
        every = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
        if self._visible is None:
            return every
        by_index = dict(every)
        uuids = {i: _text(nvml.nvmlDeviceGetUUID(h)) for i, h in every} if any(
            isinstance(v, str) for v in self._visible
        ) else {}
        chosen: list[tuple[int, Any]] = []
        for entry in self._visible:
            if isinstance(entry, int):
                match = [entry] if entry in by_index else []
            else:
                match = [i for i, u in uuids.items() if u.startswith(entry)]
            if len(match) != 1:
                raise GpuProbeError(
                    f"nvml: CUDA_VISIBLE_DEVICES entry {entry!r} matches "
                    f"{'no' if not match else 'more than one'} GPU",
                    unavailable=True,
                )
            chosen.append((match[0], by_index[match[0]]))
        return chosen

    def _read(self, nvml: Any, index: int, handle: Any) -> GpuInfo:
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except Exception as exc:  # noqa: BLE001 - mapped with the GPU named
            raise _nvml_error(exc, f"GPU {index}") from None
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=_optional(lambda: _text(nvml.nvmlDeviceGetName(handle)), ""),
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            used_bytes=int(mem.used),
            processes=_optional(lambda: _processes(nvml.nvmlDeviceGetComputeRunningProcesses(handle)), ()),
        )


def _processes(entries: Sequence[Any]) -> tuple[GpuProcess, ...]:
    # usedGpuMemory is None when the driver cannot tell (WDDM, some containers/MIG).
    return tuple(
        GpuProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
        for p in entries
    )


def _optional(read: Callable[[], T], default: T) -> T:
    """A per-device query some GPUs do not support: its absence is not an error."""
    try:
        return read()
    except Exception as exc:
        if type(exc).__name__ in _NVML_OPTIONAL:
            return default
        raise


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str; older pynvml releases returned bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


ProbeFactory = Callable[[GpuConfig], GpuProbe]


def make_probe(cfg: GpuConfig, backends: Mapping[str, ProbeFactory] | None = None) -> GpuProbe:
    """The backend ``[gpu] backend`` names: ``nvml`` and ``none`` are here; others (the
    simulator's ``simulated``) come from ``backends``, which the CLI's registry passes
    (``supervisor.cli.registry``): this module never imports the simulator."""
    if cfg.backend == "nvml":
        return NvmlProbe(cfg.indices, cfg.call_timeout_s)
    if cfg.backend == "none":
        return NoneProbe()
    factory = (backends or {}).get(cfg.backend)
    if factory is None:
        raise GpuProbeError(f"[gpu] backend {cfg.backend!r} is not available in this install", unavailable=True)
    return factory(cfg)


# --------------------------------------------------------------------------- release


@dataclass
class GpuWatch:
    """Pure bookkeeping for sampling while serving: which events a sample calls for.

    ``gpu_low_free`` fires once when a GPU's free memory drops below ``low_free_bytes`` and
    re-arms only after it climbs back above ``rearm_bytes`` (hysteresis, so a card hovering
    at the threshold does not warn every interval). ``gpu_probe_error`` fires once per
    episode of failures; a good sample ends the episode.
    """

    low_free_bytes: int
    rearm_bytes: int = 0
    _low: set[int] = field(default_factory=set, init=False)
    _failing: str | None = field(default=None, init=False)  # None | "error" | "lost"

    def __post_init__(self) -> None:
        if self.rearm_bytes < self.low_free_bytes:
            self.rearm_bytes = self.low_free_bytes + max(self.low_free_bytes // 2, 256 * 1024**2)

    @property
    def degraded(self) -> bool:
        return self._failing is not None

    def observe(self, gpus: Sequence[GpuInfo]) -> list[Event]:
        events: list[Event] = [GpuSample(gpus=tuple(_sample_fields(g) for g in gpus))]
        if self._failing is not None:
            self._failing = None
            events.append(GpuProbeFailed(error=None, degraded=False, lost=False))
        for g in gpus:
            if g.index not in self._low and g.free_bytes < self.low_free_bytes:
                self._low.add(g.index)
                events.append(GpuLowFree(index=g.index, uuid=g.uuid, free_bytes=g.free_bytes,
                                         threshold_bytes=self.low_free_bytes))
            elif g.index in self._low and g.free_bytes > self.rearm_bytes:
                self._low.discard(g.index)
        return events

    def observe_error(self, error: GpuProbeError) -> list[Event]:
        state = "lost" if error.lost else "error"
        if self._failing == state:
            return []
        self._failing = state
        return [GpuProbeFailed(error=str(error), degraded=True, lost=error.lost)]


def _sample_fields(g: GpuInfo) -> dict[str, Any]:
    return {"index": g.index, "uuid": g.uuid, "total_bytes": g.total_bytes,
            "free_bytes": g.free_bytes, "used_bytes": g.used_bytes}


class GpuMonitor:
    """Samples the probe every ``interval_s`` while serving and emits what ``GpuWatch`` says.

    ``emit(event)`` must not block (an ``EventSink.emit``). ``on_lost`` is called once
    with the error when a GPU is lost, so the daemon can give up with ``gpu_hw_error``.
    Run ``run()`` as a task; cancel it to stop. ``last`` holds the latest good sample.
    """

    def __init__(
        self,
        probe: GpuProbe,
        *,
        interval_s: float,
        low_free_bytes: int,
        emit: Callable[[Event], None],
        on_lost: Callable[[GpuProbeError], None] | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self._probe = probe
        self._interval_s = interval_s
        self._emit = emit
        self._on_lost = on_lost
        self._sleep = sleep
        self.watch = GpuWatch(low_free_bytes)
        self.last: list[GpuInfo] = []

    async def tick(self) -> None:
        """One sample and its events."""
        try:
            gpus = await self._probe.sample()
        except GpuProbeError as exc:
            events = self.watch.observe_error(exc)
            if events and exc.lost and self._on_lost is not None:
                self._on_lost(exc)
        else:
            self.last = gpus
            events = self.watch.observe(gpus)
        for event in events:
            self._emit(event)

    async def run(self) -> None:
        while True:
            await self.tick()
            await self._sleep(self._interval_s)
