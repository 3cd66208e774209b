"""Waiting for the GPUs to be released before a relaunch: logic over the ``GpuProbe`` port.

No I/O of its own: it samples whatever probe it is given (NVML, the simulator's, a test's)
and sleeps with the sleep it is given. The daemon calls it after clearing stale servers;
``gpu_memory_stuck`` is its verdict when memory stays held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.adapters.ports import GpuInfo, GpuProbe, GpuProbeError
from supervisor.core.events import GpuMemoryStuck


def gpus_released(gpus: Sequence[GpuInfo], min_free_share: float) -> bool:
    """True when every GPU has at least ``min_free_share`` of its memory free (pure)."""
    return all(g.free_bytes >= min_free_share * g.total_bytes for g in gpus)


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """How a wait for GPU memory ended. ``error`` is set when the probe itself failed."""

    ok: bool
    waited_s: float
    gpus: list[GpuInfo] = field(default_factory=list)
    error: GpuProbeError | None = None

    def describe(self, min_free_share: float) -> str:
        """One line for the log/alert: the per-GPU numbers of the cards still held."""
        if self.error is not None:
            return f"GPU probe failed: {self.error}"
        held = [g for g in self.gpus if g.free_bytes < min_free_share * g.total_bytes]
        if not held:
            return "all GPUs free"
        return (
            f"GPU memory not released after {self.waited_s:.0f} s (needs {min_free_share:.0%} free; "
            "needs a GPU reset): " + "; ".join(g.describe() for g in held)
        )

    def stuck_event(self, timeout_s: float, fraction: float | None) -> GpuMemoryStuck:
        """The ``gpu_memory_stuck`` event (``fraction``: of the server that held them)."""
        return GpuMemoryStuck(
            gpus=tuple(
                {"index": g.index, "uuid": g.uuid, "free_bytes": g.free_bytes, "total_bytes": g.total_bytes}
                for g in self.gpus
            ),
            timeout_s=timeout_s,
            mem_fraction_static=fraction,
        )


ERRORS_BEFORE_DEGRADED = 3


async def wait_until_released(
    probe: GpuProbe,
    *,
    min_free_share: float,
    timeout_s: float,
    poll_s: float = 1.0,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], Any] = asyncio.sleep,
) -> ReleaseResult:
    """Poll ``probe`` until every GPU is free enough or ``timeout_s`` passes.

    ``ok=False`` with ``error=None`` means memory stayed held (cause ``gpu_memory_stuck``,
    numbers in ``gpus``). A probe error that cannot pass by waiting (``lost`` or
    ``unavailable``) returns at once with ``error`` set; a transient one is retried, and
    after ``ERRORS_BEFORE_DEGRADED`` in a row it returns too (the caller runs degraded
    rather than hold a relaunch for the whole timeout). With no GPUs to watch (backend
    ``none``) it is ``ok`` at once.
    """
    now = clock or asyncio.get_running_loop().time
    start = now()
    last: list[GpuInfo] = []
    errors_in_a_row = 0
    while True:
        error: GpuProbeError | None = None
        try:
            last = await probe.sample()
            errors_in_a_row = 0
        except GpuProbeError as exc:
            error = exc
            errors_in_a_row += 1
            if exc.lost or exc.unavailable or errors_in_a_row >= ERRORS_BEFORE_DEGRADED:
                return ReleaseResult(False, now() - start, last, exc)
        if error is None and gpus_released(last, min_free_share):
            return ReleaseResult(True, now() - start, last)
        remaining = start + timeout_s - now()
        if remaining <= 0:
            return ReleaseResult(False, now() - start, last, error)
        await sleep(min(poll_s, remaining))


# --------------------------------------------------------------------------- monitor
