"""Preparing a launch: our old servers off the GPUs, the GPUs' memory released, preflight,
and what the fleet learned of this configuration.

``Preparation.run`` returns the core's events for it: ``Prepared`` (after a ``FleetAdvice``
with ``[fleet]`` on), or ``PrepareFailed`` with what it found. What a finding means (its
cause, whether a retry can help) is the core's (``machine._prepare_cause``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from supervisor.adapters.ports import GpuInfo, GpuProbeError, StaleReport, UnitPorts
from supervisor.core import events as ev
from supervisor.core.config import Config
from supervisor.core.messages import Event, Finding, Prepared, PrepareFailed
from supervisor.core.ownership import server_env
from supervisor.services import release
from supervisor.unit.handover import HandOver

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from supervisor.services.fleet_sync import FleetSync


class Preparation:
    """One unit's preparations (see the module docstring): given, when the unit starts, the
    hand-over of a server a previous daemon left and, with ``[fleet]``, the fleet's sync."""

    def __init__(
        self, ports: UnitPorts, *, instance_id: str, handover: HandOver, fleet: FleetSync | None,
        emit: Callable[[ev.Event], None], log: FilteringBoundLogger,
    ) -> None:
        self.p = ports
        self.instance_id = instance_id
        self.handover = handover
        self.fleet = fleet
        self._emit = emit
        self.log = log
        # What the next launch runs on (its ``launch`` event says it): the GPUs' names from
        # the last sample that saw some, and the server's SGLang version, read once per
        # command and environment.
        self.gpu_names: tuple[str, ...] = ()
        self.sglang_version = ""
        self._versions: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], str] = {}

    async def run(self, cfg: Config, fraction: float | None) -> list[Event]:
        """Clear our old servers off the GPUs, wait for memory, run preflight (``fraction``:
        the one about to be launched, for the report of memory that stays held)."""
        try:
            return await self._run(cfg, fraction)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an adapter bug must not kill the daemon
            self.log.exception("prepare_failed", error=repr(exc)[:300])
            return [PrepareFailed(Finding.INTERNAL, f"internal error: {exc!r}"[:300])]

    async def _run(self, cfg: Config, fraction: float | None) -> list[Event]:
        gpus = await self._sample_or_none()
        if gpus:
            self.gpu_names = tuple(" ".join(g.name.split()) or "unknown GPU" for g in gpus)
        self.sglang_version = await self._version(cfg)
        holders = {p.pid: (g.index, p.used_bytes) for g in gpus for p in g.processes}
        handover = self.handover
        report = await self._find_stale(cfg, list(holders))
        drained = False
        if handover.left:  # a server the last daemon left
            drained = await handover.drain(report)
            if drained:
                report = await self._find_stale(cfg, list(holders))  # it may have forked meanwhile
        for proc in report.foreign:
            index, used = holders.get(proc.pid, (None, None))
            self._emit(ev.ForeignGpuProcess(pid=proc.pid, name=proc.name, cmdline=proc.cmdline,
                                            reason=proc.reason, gpu=index, used_bytes=used))
        if report.port_holders and not cfg.gpu.kill_foreign:
            # Not ours (no mark, not our process group): reported, never killed.
            self._emit(ev.PortInUse(port=cfg.server.port, holders=tuple(p.to_dict() for p in report.port_holders)))
            who = ", ".join(f"pid {p.pid} {p.name or '?'}" for p in report.port_holders)
            return [PrepareFailed(Finding.PORT_HELD, f"port {cfg.server.port} is held by {who}, not ours")]
        foreign = report.foreign or report.port_holders
        if report.ours or (foreign and cfg.gpu.kill_foreign):
            grace = cfg.server.stop_grace_s if drained else min(cfg.server.stop_grace_s, 10.0)
            killed = await self.p.cleanup.kill_stale(report, grace_s=grace, kill_foreign=cfg.gpu.kill_foreign)
            self._emit(ev.OrphansKilled(
                pids=tuple(killed), titles=tuple(p.name for p in report.ours), reasons=tuple(p.reason for p in report.ours),
            ))
        handover.cleared()
        if cfg.gpu.backend != "none":
            result = await release.wait_until_released(
                self.p.gpu_probe, min_free_share=cfg.gpu.free_share_min, timeout_s=cfg.gpu.release_timeout_s,
                poll_s=min(1.0, cfg.gpu.interval_s),
            )
            if result.error is not None and result.error.lost:
                return [PrepareFailed(Finding.GPU_LOST, str(result.error), permanent=True)]
            if result.error is not None:
                # Degraded: we cannot see the GPUs, so we cannot prove them free. Launch
                # anyway (the server's own start-up OOM would tell) and say so once.
                self._emit(ev.GpuProbeFailed(error=str(result.error), degraded=True, lost=False))
            elif not result.ok:
                self._emit(result.stuck_event(cfg.gpu.release_timeout_s, fraction))
                return [PrepareFailed(Finding.GPU_STUCK, result.describe(cfg.gpu.free_share_min), permanent=True)]
        checks = await self.p.preflight.run_preflight(cfg, self.p.gpu_probe, degraded_ok=True)
        failed = [c for c in checks if not c.ok]
        if failed:
            self._emit(ev.PreflightFailed(
                checks=tuple({"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks),
                permanent=any(c.permanent for c in failed),
            ))
            return [PrepareFailed(
                Finding.PREFLIGHT, "; ".join(f"{c.name}: {c.detail}" for c in failed),
                permanent=any(c.permanent for c in failed), checks=tuple(c.name for c in failed),
            )]
        if self.fleet is not None:
            # What the fleet learned of this configuration, applied before the launch.
            return [await self.fleet.advice(cfg, gpus or await self._sample_or_none()), Prepared()]
        return [Prepared()]

    async def _find_stale(self, cfg: Config, gpu_pids: list[int]) -> StaleReport:
        recorded = self.handover.recorded
        return await asyncio.to_thread(
            self.p.cleanup.find_stale,
            recorded_pgid=recorded.pgid,
            gpu_pids=gpu_pids,
            own_pid=os.getpid(),
            port=cfg.server.port,
            recorded_since=recorded.since,
            instance=self.instance_id,
            recorded_tree=recorded.tree,
            recorded_boot=recorded.boot,
            recorded_started=recorded.started,
        )

    async def _version(self, cfg: Config) -> str:
        """The server's SGLang version, or "" (no reader, or it could not be read: the report
        says so); with ``[fleet]`` the fleet's own read, so it runs once."""
        if self.fleet is not None:
            try:
                return await self.fleet.version(cfg)
            except Exception:  # noqa: BLE001 - the fleet's key says why in its own fleet_error
                return ""
        read = self.p.sglang_version
        if read is None:
            return ""
        env = server_env(cfg.server.pass_env, cfg.server.env, self.p.environ)
        key = (tuple(cfg.server.command), tuple(sorted(env.items())))
        if key not in self._versions:
            try:
                self._versions[key] = await asyncio.to_thread(read, cfg.server.command, env)
            except Exception:  # noqa: BLE001 - VersionError or a probe that could not run: not a reason to stop
                self._versions[key] = ""
        return self._versions[key]

    async def _sample_or_none(self) -> list[GpuInfo]:
        try:
            return await self.p.gpu_probe.sample()
        except GpuProbeError:
            return []
