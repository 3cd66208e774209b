"""The daemon's ports: the small interfaces through which the I/O shell reaches the world.

``Daemon`` sees only these ``Protocol``s. The CLI (the composition root,
``cli.run_daemon_async``) passes the real adapters: modules and classes that satisfy them
structurally (``cleanup``, ``preflight``, ``ServerProcess``, ``HealthProber``,
``gpu.GpuMonitor``, ``control.ControlServer.start``, ``cgroup.cgroup_oom_kills``). Tests pass
fakes of their own (``tests/test_daemon_component.py``), so the shell's paths can be driven
without a subprocess, a socket or a GPU.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .gpu import GpuProbe, GpuProbeError, NoneProbe

if TYPE_CHECKING:
    import signal

    from .cleanup import StaleReport
    from .config import Config
    from .events import EventSink
    from .health import ProbeOutcome
    from .model import ExitStatus
    from .preflight import Check
    from .process import RotatingLog

__all__ = [
    "Cleanup", "ControlHandle", "ControlStarter", "GpuMonitorFactory", "GpuProbe",
    "Monitor", "NullNotifier", "OomKillReader", "Ports", "Preflight", "Prober", "ProberFactory",
    "ServerHandle", "ServerSpawner", "Store",
]


class Store(Protocol):
    """The state directory: its lock and the learned state (``store.StateStore``); raises
    ``store.StoreError``."""

    path: Path

    def acquire(self) -> None: ...
    def release(self) -> None: ...
    def load(self) -> tuple[dict[str, Any] | None, str | None]: ...
    def save(self, data: dict[str, Any]) -> None: ...


class Cleanup(Protocol):
    """Finding and killing what an earlier server of ours left (the ``cleanup`` module)."""

    def find_stale(
        self,
        *,
        recorded_pgid: int | None,
        gpu_pids: Collection[int],
        own_pid: int,
        port: int | None = ...,
        recorded_since: float | None = ...,
        instance: str | None = ...,
        recorded_tree: Collection[tuple[int, float]] = ...,
    ) -> StaleReport:
        """Blocking: the daemon calls it in a worker thread."""
        ...

    async def kill_stale(self, report: StaleReport, *, grace_s: float, kill_foreign: bool = ...) -> list[int]: ...

    def listeners(self, port: int) -> set[int]:
        """Pids listening on ``port`` (blocking)."""
        ...


class Preflight(Protocol):
    """The checks before a launch (the ``preflight`` module)."""

    async def run_preflight(self, cfg: Config, probe: GpuProbe, *, degraded_ok: bool = ...) -> list[Check]: ...


class Tail(Protocol):
    def get(self) -> bytes: ...


class ServerHandle(Protocol):
    """One launched server, as the daemon drives it (``process.ServerProcess``)."""

    on_line: Callable[[str], None] | None  # each output line while set (startup)
    on_part_died: Callable[[int, str], None] | None  # (pid, title) of an SGLang part that died

    @property
    def pid(self) -> int: ...
    @property
    def pgid(self) -> int: ...
    @property
    def tail(self) -> Tail: ...  # the last output, for the diagnosis
    @property
    def last_output_at(self) -> float: ...  # loop time of the last output
    @property
    def returncode(self) -> int | None: ...
    async def wait(self) -> ExitStatus: ...
    def kill_leftovers(self) -> list[int]: ...
    async def drain_output(self, timeout_s: float) -> None: ...
    def scan_descendants(self) -> list[tuple[int, str]]: ...
    def watch_parts(self, parts: Sequence[tuple[int, str]]) -> None: ...
    def tree_pids(self) -> list[int]: ...
    def tree(self) -> list[tuple[int, float]]: ...
    async def stop(self, grace_s: float, first: signal.Signals | None = ...) -> ExitStatus: ...
    async def close(self) -> None: ...


class ServerSpawner(Protocol):
    """Starts a server (the ``ServerProcess`` class); raises ``process.ProcessError``."""

    async def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None, log: RotatingLog, tail_bytes: int,
    ) -> ServerHandle: ...


class Prober(Protocol):
    async def probe(self) -> ProbeOutcome: ...
    async def aclose(self) -> None: ...


ProberFactory = Callable[[str, float], Prober]
"""(url, timeout_s) -> a prober (the ``HealthProber`` class)."""


class Monitor(Protocol):
    async def run(self) -> None: ...


class GpuMonitorFactory(Protocol):
    """Builds the GPU monitor (the ``gpu.GpuMonitor`` class)."""

    def __call__(
        self,
        probe: GpuProbe,
        *,
        interval_s: float,
        low_free_bytes: int,
        emit: Callable[[str, Mapping[str, Any]], None],
        on_lost: Callable[[GpuProbeError], None] | None = ...,
    ) -> Monitor: ...


class ControlHandle(Protocol):
    async def close(self) -> None: ...


ControlStarter = Callable[[Path, Callable[[Mapping[str, Any]], dict[str, Any]]], Awaitable[ControlHandle]]
"""(socket path, handler) -> a listening control socket (``control.ControlServer.start``);
raises ``control.ControlError``."""

OomKillReader = Callable[[str | None], int | None]
"""The cgroup's ``oom_kill`` count, from the file given or our own cgroup's (blocking;
``cgroup.cgroup_oom_kills``)."""


class NullNotifier:
    """systemd's notify protocol when nobody listens: every call does nothing."""

    def ready(self) -> None: ...
    def status(self, text: str) -> None: ...
    def stopping(self) -> None: ...
    def reloading(self) -> None: ...
    def watchdog(self) -> None: ...
    def watchdog_interval(self) -> float | None:
        return None


@dataclass
class Ports:
    """The adapters the daemon drives; the CLI builds the real ones, tests their fakes."""

    store: Store
    sinks: list[EventSink]
    logger: Any
    cleanup: Cleanup
    preflight: Preflight
    spawner: ServerSpawner
    prober: ProberFactory
    gpu_monitor: GpuMonitorFactory
    start_control: ControlStarter
    oom_kills: OomKillReader
    gpu_probe: GpuProbe = field(default_factory=NoneProbe)
    notifier: Any = field(default_factory=NullNotifier)  # sdnotify.Notifier in production
    rng: random.Random = field(default_factory=random.Random)
    reload: Callable[[], Config] | None = None  # SIGHUP: re-read the config
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    host: str = field(default_factory=socket.gethostname)
    install_signals: bool = True
