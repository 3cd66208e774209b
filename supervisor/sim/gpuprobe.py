"""The ``simulated`` GPU backend: the daemon's probe over the simulator's GPU files.

The CLI's registry (``supervisor.cli.registry``) hands it to ``adapters.gpu.make_probe``;
nothing else in the product imports it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from supervisor.adapters.gpu import BoundedWorker
from supervisor.adapters.ports import GpuInfo, GpuProbeError, GpuProcess
from supervisor.sim import simgpu


class SimulatedProbe:
    """``backend = "simulated"``: reads the simulator's GPU directory (``supervisor.sim.simgpu``)."""

    def __init__(
        self, sim_dir: str | os.PathLike[str], indices: Sequence[int] = (), call_timeout_s: float = 5.0
    ) -> None:
        self._dir = os.fspath(sim_dir)
        self._indices = tuple(indices)
        self._worker = BoundedWorker("simulated GPU", call_timeout_s)
        self._reads: simgpu.Reads = {}  # the files' parsed content, read again only when rewritten

    async def sample(self) -> list[GpuInfo]:
        return await self._worker.call(self._read)

    def _read(self) -> list[GpuInfo]:
        try:
            gpus = simgpu.read_gpus(self._dir, self._reads)
        except FileNotFoundError:
            raise GpuProbeError(
                f"simulated GPU: {self._dir} has no {simgpu.GPUS_FILE}", unavailable=True
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise GpuProbeError(f"simulated GPU: cannot read {self._dir}: {exc}") from None
        wanted = set(self._indices)
        return [
            GpuInfo(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                total_bytes=g.total_bytes,
                free_bytes=g.free_bytes,
                used_bytes=g.used_bytes,
                processes=tuple(GpuProcess(pid, used) for pid, used in g.processes),
            )
            for g in gpus
            if not wanted or g.index in wanted
        ]

    async def aclose(self) -> None:
        return None
