"""The daemon's ports: the small interfaces through which the I/O shell reaches the world,
and the values and errors that cross them.

``Daemon`` sees only these ``Protocol``s. The CLI (the composition root,
``supervisor.cli.run``) passes the real adapters: modules and classes that satisfy them
structurally (``cleanup``, ``preflight.HostPreflight``, ``ServerProcess``, ``RotatingLog``,
``HealthProber``, ``gpu.GpuMonitor``, ``control.ControlServer.start``,
``cgroup.cgroup_oom_kills``). Tests pass fakes of their own
(``tests/test_daemon_component.py``), so the shell's paths can be driven without a
subprocess, a socket or a GPU.

Every adapter imports its value types and errors from here (``GpuInfo``, ``StaleReport``,
``ProbeOutcome``, ``Check``, ``ProcessError``, ``StoreError``...), never from another
adapter: adapters are independent of each other (the import-linter contracts in
``pyproject.toml``).
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import signal

    from structlog.typing import FilteringBoundLogger

    from supervisor.core.config import Config
    from supervisor.core.events import Event, EventSink
    from supervisor.core.model import ExitStatus

__all__ = [
    "Check", "Cleanup", "ControlHandle", "ControlHandler", "ControlReply", "ControlStarter", "GpuInfo", "GpuMonitorFactory", "GpuProbe",
    "GpuProbeError", "GpuProcess", "LogOpener", "Monitor", "NoneProbe", "NullNotifier", "OomKillReader",
    "Ports", "Preflight", "UnitPorts", "ProbeOutcome", "Prober", "ProberFactory", "ProcInfo", "ProcessError", "Router", "RouterError", "RouterWorker",
    "ControlError", "Etcd", "EtcdError", "FleetStore", "KeyValue", "Leadership", "Lease", "WatchEvent", "ReapedChild", "ReaperError", "ReaperHandle", "ReaperStarter",
    "ServerHandle", "ServerLog", "ServerSpawner", "StaleReport", "Store", "StoreError", "VersionReader",
]


# --- what crosses the ports: values and errors ------------------------------------------

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU. ``used_bytes`` is None when the driver does not say."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU's memory as the probe saw it."""

    index: int
    uuid: str
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    processes: tuple[GpuProcess, ...] = ()

    @property
    def free_share(self) -> float:
        return self.free_bytes / self.total_bytes if self.total_bytes > 0 else 0.0

    def describe(self) -> str:
        """``GPU 0 (GPU-5151...): 12.0 of 141.0 GiB free (9%); held by pid 4242 (100.0 GiB)``."""
        held = ", ".join(
            f"pid {p.pid} ({_gib(p.used_bytes)})" if p.used_bytes is not None else f"pid {p.pid}"
            for p in self.processes
        )
        return (
            f"GPU {self.index} ({self.uuid}): {self.free_bytes / GIB:.1f} of "
            f"{self.total_bytes / GIB:.1f} GiB free ({self.free_share:.0%})"
            + (f"; held by {held}" if held else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "used_bytes": self.used_bytes,
            "processes": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in self.processes],
        }


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


class GpuProbeError(Exception):
    """The probe could not read the GPUs. ``str()`` is one line for the log.

    ``lost``: a GPU has fallen off the bus or needs a reset (cause ``gpu_hw_error``).
    ``unavailable``: the backend cannot work on this host (no library/driver/package);
    waiting will not help, so callers run degraded rather than wait for it.
    """

    def __init__(self, message: str, *, lost: bool = False, unavailable: bool = False) -> None:
        super().__init__(message)
        self.lost = lost
        self.unavailable = unavailable


class GpuProbe(Protocol):
    """What the daemon needs from a GPU backend."""

    async def sample(self) -> list[GpuInfo]: ...

    async def aclose(self) -> None: ...


class NoneProbe:
    """``backend = "none"``: no GPU knowledge."""

    async def sample(self) -> list[GpuInfo]:
        return []

    async def aclose(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """A process found holding our GPUs/port or in our process group."""

    pid: int
    name: str = ""
    cmdline: str = ""
    create_time: float | None = None  # None: not visible in our /proc (another pid namespace)
    reason: str = ""  # why it is ours, or "gpu" / "unknown pid" for foreign ones
    started: int | None = None  # its start in ticks since boot (procstart), when read

    @property
    def visible(self) -> bool:
        return self.create_time is not None

    def to_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "name": self.name, "cmdline": self.cmdline, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class StaleReport:
    ours: list[ProcInfo] = field(default_factory=list)
    foreign: list[ProcInfo] = field(default_factory=list)  # on our GPUs or our port, not ours
    port_holders: list[ProcInfo] = field(default_factory=list)  # foreign listeners on our port


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    ok: bool
    status: int | None
    duration_s: float
    detail: str


@dataclass(frozen=True, slots=True)
class Check:
    """One preflight check: its verdict, a one-line detail, and whether waiting can change it.
    ``warning``: passed, but with something to look at (an SGLang release not tested)."""

    name: str
    ok: bool
    detail: str
    permanent: bool = False
    warning: bool = False


class StoreError(Exception):
    """The state directory could not be read or written."""


class ProcessError(Exception):
    """The server could not be started."""


@dataclass(frozen=True, slots=True)
class ReapedChild:
    """A zombie child the reaper collected: an orphan reparented to the daemon."""

    pid: int
    name: str  # its comm (the kernel keeps 15 characters: "sglang::schedul")
    returncode: int  # Popen's convention: -N when killed by signal N


class ReaperError(Exception):
    """The daemon cannot become a child subreaper here (not Linux, no prctl); one line."""


class ControlError(Exception):
    """The control socket cannot be served or reached; ``str()`` is one line."""


@dataclass(frozen=True, slots=True)
class RouterWorker:
    """One worker as SGLang's router lists it (``GET /workers``)."""

    id: str
    url: str
    healthy: bool
    load: int | None = None


class RouterError(Exception):
    """A router call failed (refused, timed out, a non-2xx answer, bad JSON); ``str()`` is
    one line naming the operation and the router's URL, never its token. ``status`` is the
    HTTP status when the router answered, else None."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerLog(Protocol):
    """The server's log (``output.RotatingLog``), given views of the pump's buffer: copy what is kept."""

    def write(self, data: bytes | memoryview) -> None: ...
    def close(self) -> None: ...


class LogOpener(Protocol):
    """Opens the server log (the ``process.RotatingLog`` class): write errors go to
    ``on_error`` once per episode, never up."""

    def __call__(
        self, path: str | Path, max_bytes: int, backups: int, *, on_error: Callable[[str], None] | None = ...,
    ) -> ServerLog: ...


# --- the ports ---------------------------------------------------------------------------


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

    def instance_id(self, state_dir: str) -> str:
        """This daemon's ownership mark, derived from its state directory and host."""
        ...

    def find_stale(
        self, *, recorded_pgid: int | None, gpu_pids: Collection[int], own_pid: int, port: int | None = ...,
        recorded_since: float | None = ..., instance: str | None = ...,
        recorded_tree: Collection[tuple[int, float]] = ...,
        recorded_boot: str | None = ..., recorded_started: Collection[tuple[int, int]] = ...,
    ) -> StaleReport:
        """Blocking: the daemon calls it in a worker thread."""
        ...

    async def kill_stale(self, report: StaleReport, *, grace_s: float, kill_foreign: bool = ...) -> list[int]: ...

    def listeners(self, port: int) -> set[int]:
        """Pids listening on ``port`` (blocking)."""
        ...


class Preflight(Protocol):
    """The checks before a launch (``services.preflight.HostPreflight``)."""

    async def run_preflight(self, cfg: Config, probe: GpuProbe, *, degraded_ok: bool = ...) -> list[Check]: ...


class Router(Protocol):
    """SGLang's router's worker API (the ``router.RouterClient`` class); raises ``RouterError``;
    every call is bounded by the client's timeout."""

    async def list_workers(self) -> list[RouterWorker]: ...
    async def add(self, worker_url: str) -> str:
        """Registers the worker; returns the id the router gave it. The router adds it in the
        background: it is listed only once the router has reached it (docs/router.md)."""
        ...
    async def remove(self, worker_id: str) -> None:
        """An id the router does not know counts as removed."""
        ...
    async def aclose(self) -> None: ...


# -- etcd ([group], [fleet]; the client is adapters.etcd.EtcdClient) -------------------------


class EtcdError(Exception):
    """etcd could not be reached or refused; ``str()`` is one line: endpoint, operation, why."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes  # empty for a delete
    revision: int  # the store's revision at this change (the key's mod_revision)
    create_revision: int = 0  # the key's create revision (a put; 0 for a delete)


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl_s: int


@dataclass(frozen=True, slots=True)
class Leadership:
    """A won election: our candidate key, its create revision (our place in line), its lease."""

    key: str
    revision: int
    lease: Lease


class Etcd(Protocol):
    """What the daemon needs from etcd; ``EtcdClient`` is the real one, tests may fake it."""

    async def connect(self) -> None: ...
    async def aclose(self) -> None: ...
    async def grant(self, ttl_s: int) -> Lease: ...
    async def keep_alive(self, lease: Lease) -> None: ...
    async def revoke(self, lease: Lease) -> None: ...
    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int: ...
    async def get(self, key: str) -> KeyValue | None: ...
    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]: ...
    async def put_if(self, key: str, value: bytes, mod_revision: int, lease: Lease | None = None) -> int | None: ...
    async def put_all(
        self, items: Mapping[str, bytes], expect: Mapping[str, int] | None = None, lease: Lease | None = None,
    ) -> int | None: ...
    async def delete(self, key: str) -> bool: ...
    async def delete_prefix(self, prefix: str) -> int: ...
    def watch_prefix(self, prefix: str, start_revision: int = 0) -> AsyncIterator[WatchEvent]: ...
    async def campaign(self, prefix: str, lease: Lease, value: bytes = b"") -> Leadership: ...
    async def resign(self, leadership: Leadership) -> None: ...
    async def leader(self, prefix: str) -> KeyValue | None: ...


class FleetStore(Protocol):
    """etcd as fleet memory uses it (``etcd.EtcdClient``; docs/fleet.md). Every call is
    bounded by the client's timeout and raises the client's one error type."""

    async def get(self, key: str) -> KeyValue | None: ...
    async def put_if(self, key: str, value: bytes, mod_revision: int) -> int | None:
        """Compare-and-swap (0: only if absent); None when another writer was first."""
        ...


# The SGLang version a ``[server] command`` runs, from its Python's package metadata,
# given the server's environment (blocking: called in a thread; raises on failure).
VersionReader = Callable[[Sequence[str], Mapping[str, str]], str]


class Tail(Protocol):
    def get(self) -> bytes: ...

    @property
    def total(self) -> int: ...  # bytes appended since the launch (the tail holds the last of them)


class ServerHandle(Protocol):
    """One launched server, as the daemon drives it (``process.ServerProcess``)."""

    on_line: Callable[[str], None] | None  # each output line while set (startup)
    spotted: tuple[bytes, ...]  # while on_line is None: the words whose lines go to on_spotted
    on_spotted: Callable[[str], None] | None
    on_part_died: Callable[[int, str], None] | None  # (pid, title) of an SGLang part that died

    @property
    def pid(self) -> int: ...
    @property
    def pgid(self) -> int: ...
    @property
    def started(self) -> int | None: ...  # the main process's start, ticks since boot (procstart)
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
    def starts(self) -> tuple[str, list[tuple[int, int]]]: ...  # the boot, (pid, start) of the tree
    async def stop(self, grace_s: float, first: signal.Signals | None = ...) -> ExitStatus: ...
    async def close(self) -> None: ...
    def hand_over(self) -> dict[str, Any]: ...  # a re-exec: stop reading, say what the next program needs
    def resume(self) -> None: ...  # the exec failed: read on
    @property
    def kept_fds(self) -> list[int]: ...


class ServerSpawner(Protocol):
    """Starts a server (the ``ServerProcess`` class); raises ``process.ProcessError``. ``adopt``
    takes on one a re-exec handed over (``ServerHandle.hand_over``'s fields)."""

    async def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None, log: ServerLog, tail_bytes: int,
    ) -> ServerHandle: ...

    def adopt(self, pid: int, pipe_fd: int, *, log: ServerLog, tail_bytes: int, tail: bytes, tail_total: int,
              known: Sequence[tuple[int, float]], parts: Sequence[tuple[int, int, str]],
              known_started: Sequence[tuple[int, int]] | None = None) -> ServerHandle: ...


class Prober(Protocol):
    async def probe(self) -> ProbeOutcome: ...
    async def aclose(self) -> None: ...


ProberFactory = Callable[[str, float], Prober]
"""(url, timeout_s) -> a prober (the ``HealthProber`` class)."""


class KvReader(Protocol):
    """SGLang's KV-pool usage and queue from its ``/metrics`` (``health.KvMetricsReader``)."""

    async def read(self) -> tuple[float, int] | None: ...
    async def aclose(self) -> None: ...


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
        emit: Callable[[Event], None],
        on_lost: Callable[[GpuProbeError], None] | None = ...,
    ) -> Monitor: ...


class ControlHandle(Protocol):
    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ControlReply:
    """An answer and the lines that follow it on the same connection (``restart`` waiting for
    the pass: its progress, then how it ended); ``close`` is called once the connection ends,
    however it ends."""

    answer: dict[str, Any]
    then: AsyncIterator[dict[str, Any]]
    close: Callable[[], None]


ControlHandler = Callable[[Mapping[str, Any]], "dict[str, Any] | ControlReply"]
ControlStarter = Callable[[str, ControlHandler], Awaitable[ControlHandle]]
"""(state dir, handler) -> a listening control socket in that directory (``control.serve``);
raises ``ControlError``."""

class ReaperHandle(Protocol):
    """The running reaper (``reaper.Reaper``): ``mode`` is "pid1" or "subreaper"."""

    @property
    def mode(self) -> str: ...
    def close(self) -> None: ...


ReaperStarter = Callable[[Callable[[], Collection[int]], Callable[[Sequence[ReapedChild]], None]], ReaperHandle]
"""(keep, on_reaped) -> a started reaper (``reaper.start``), on the running loop: the process
becomes a child subreaper, and every zombie child whose pid is not in ``keep()`` (the server
processes, whose exit status is their watcher's) is collected and handed to ``on_reaped``.
Raises ``ReaperError``."""

OomKillReader = Callable[[str | None], int | None]
"""The cgroup's ``oom_kill`` count, from the file given or our own cgroup's (blocking;
``cgroup.cgroup_oom_kills``)."""


class SdNotifier(Protocol):
    """systemd's notify protocol (``sdnotify.Notifier``): whether a message went is its own
    business (it logs a failing socket once)."""

    def ready(self) -> object: ...
    def status(self, text: str) -> object: ...
    def stopping(self) -> object: ...
    def reloading(self) -> object: ...
    def watchdog(self) -> object: ...
    def watchdog_interval(self) -> float | None: ...


class NullNotifier:
    """systemd's notify protocol when nobody listens: every call does nothing."""

    def ready(self) -> None: ...
    def status(self, text: str) -> None: ...
    def stopping(self) -> None: ...
    def reloading(self) -> None: ...
    def watchdog(self) -> None: ...
    def watchdog_interval(self) -> float | None:
        return None


@dataclass(frozen=True, slots=True)
class UnitPorts:
    """What one server's unit reaches the world through: its own state store, the probe of
    its GPUs and its own sinks (its metrics, its alerts), and the adapters all units share.
    A daemon of one ``[server]`` has one of these, a daemon of several one per server: one
    server is a list of one (``Ports.units``)."""

    store: Store
    logger: FilteringBoundLogger
    cleanup: Cleanup
    preflight: Preflight
    spawner: ServerSpawner
    prober: ProberFactory
    gpu_monitor: GpuMonitorFactory
    open_log: LogOpener
    oom_kills: OomKillReader
    gpu_probe: GpuProbe = field(default_factory=NoneProbe)
    sinks: Sequence[EventSink] = ()
    router: Router | None = None  # SGLang's router's client when [router] enabled
    # [group]: the etcd client (adapters.etcd.EtcdClient, not connected) the group sync uses.
    group_etcd: Etcd | None = None
    # [fleet] on: etcd's client (connected on first use) and the SGLang version reader.
    fleet_store: FleetStore | None = None
    sglang_version: VersionReader | None = None
    # (url, timeout_s) -> SGLang's /metrics reader, for a server run with --enable-metrics.
    kv_reader: Callable[[str, float], KvReader] | None = None
    rng: random.Random = field(default_factory=random.Random)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    host: str = field(default_factory=socket.gethostname)


class ReexecPort(Protocol):
    """Re-executing the daemon in place (``adapters.reexec``; the CLI builds it)."""

    inherited: Mapping[str, Any] | None  # the hand-over this program was exec'd with
    inherited_error: str | None  # why a hand-over could not be read (its servers are relaunched)

    async def check(self) -> str | None: ...  # the installed code's check: None, or why not
    async def before_exec(self) -> None: ...  # MQTT's clean disconnect (no Last Will)
    async def after_failed_exec(self) -> None: ...  # MQTT again
    def exec(self, doc: Mapping[str, Any], keep_fds: Sequence[int]) -> None: ...  # raises OSError


@dataclass
class Ports:
    """The daemon's own ports: what there is one of (its state directory's lock, its sinks,
    the control socket, systemd, signals, the orphan reaper), and each server's
    (``units``: a server's config -> its ``UnitPorts``). The CLI builds the real ones, tests
    their fakes."""

    store: Store  # the daemon's state directory: its lock (a single server's store too)
    sinks: list[EventSink]
    logger: FilteringBoundLogger
    start_control: ControlStarter
    units: Callable[[Config], UnitPorts]
    notifier: SdNotifier = field(default_factory=NullNotifier)  # sdnotify.Notifier in production
    reload: Callable[[], Config] | None = None  # SIGHUP: re-read the config
    host: str = field(default_factory=socket.gethostname)
    install_signals: bool = True
    # Reaping orphans (a child subreaper, or PID 1 in a container): only for a daemon that
    # owns its process (the CLI's), never one embedded in another program (tests).
    reaper: ReaperStarter | None = None
    # A shutdown past its deadline (docs/reliability.md): the retained `offline` published
    # over fresh connections, bounded by the seconds given; then the process ends at once
    # with the code given (os._exit). Both only for a daemon that owns its process.
    publish_offline: Callable[[float], Awaitable[None]] | None = None
    hard_exit: Callable[[int], None] | None = None
    # Re-exec in place (``reexec``, SIGUSR2): only for a daemon that owns its process.
    reexec: ReexecPort | None = None
