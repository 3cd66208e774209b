"""What the shell saw around a server: before a launch (preflight, foreign processes, orphans, the hand-over), while serving (probes, GPU samples), the router and the fleet."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.core.events.base import Event, Json

# --- before a launch -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightFailed(Event):
    kind = "preflight_failed"
    checks: tuple[Json, ...]  # {name, ok, detail}
    permanent: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ForeignGpuProcess(Event):
    kind = "foreign_gpu_process"
    pid: int
    name: str
    cmdline: str
    reason: str
    gpu: int | None
    used_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PortInUse(Event):
    """A process that is not ours holds the server's port: reported, never killed unless
    ``[gpu] kill_foreign``."""

    kind = "port_in_use"
    alert = "port_in_use"
    severity = "warning"
    port: int
    holders: tuple[Json, ...]  # {pid, name, cmdline, reason}


@dataclass(frozen=True, slots=True, kw_only=True)
class OrphansReaped(Event):
    """Zombie children collected by the daemon (a child subreaper, or PID 1 in a container):
    orphans reparented to it, typically a server's schedulers killed after its main process
    died. One event per sweep; the server's own main process is never among them."""

    kind = "orphans_reaped"
    pids: tuple[int, ...]
    names: tuple[str, ...]
    returncodes: tuple[int, ...]  # -N: killed by signal N


@dataclass(frozen=True, slots=True, kw_only=True)
class OrphansKilled(Event):
    """Stale servers of ours cleared before a launch."""

    kind = "orphans_killed"
    pids: tuple[int, ...]
    titles: tuple[str, ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class InheritedServer(Event):
    """[router]: the server a killed daemon left still serves behind the router. It is
    replaced one at a time: ``waiting`` (until another server serves), then ``replacing``
    (out of the router, drained, stopped, relaunched)."""

    kind = "inherited_server"
    step: str
    pgid: int | None
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuMemoryStuck(Event):
    kind = "gpu_memory_stuck"
    alert = "gpu_memory_stuck"
    severity = "critical"
    gpus: tuple[Json, ...]  # {index, uuid, free_bytes, total_bytes}
    timeout_s: float
    mem_fraction_static: float | None  # of the server that held them


# --- while serving ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeAnswered(Event):
    kind = "probe"
    quiet = True
    ok: bool
    duration_s: float
    status: int | None  # the HTTP code
    error: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSample(Event):
    """Every ``[gpu] interval_s``."""

    kind = "gpu_sample"
    quiet = True
    gpus: tuple[Json, ...]  # {index, uuid, total_bytes, free_bytes, used_bytes}


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuLowFree(Event):
    """Once per episode."""

    kind = "gpu_low_free"
    index: int
    uuid: str
    free_bytes: int
    threshold_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuProbeFailed(Event):
    """The GPU probe failed (``error``), or works again (``error`` None, not degraded)."""

    kind = "gpu_probe_error"
    error: str | None
    degraded: bool
    lost: bool = False


# --- the router ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterRegistered(Event):
    """The server is in the router (added, or an entry of ours adopted)."""

    kind = "router_registered"
    worker_url: str
    worker_id: str
    adopted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterRemoved(Event):
    """The server is out of the router; ``after_s``: from the moment the daemon decided
    (the death noticed, or the stop about to begin) to the router's answer."""

    kind = "router_removed"
    worker_url: str
    worker_ids: tuple[str, ...]
    reason: str
    after_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterCallFailed(Event):
    """A router call failed; it is retried on the backoff (supervision goes on)."""

    kind = "router_call_failed"
    op: str  # add | remove | list
    error: str
    retry_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetApplied(Event):
    """The fleet's record (docs/fleet.md) knew this configuration at a lower rung than ours:
    the next launch starts at ``mem_fraction_static`` (the fleet's, or our floor if the
    fleet's is below it) instead of ``own_mem_fraction_static``."""

    kind = "fleet_applied"
    key: str
    mem_fraction_static: float
    fleet_mem_fraction_static: float
    own_mem_fraction_static: float | None
    source: str  # "HOST/SERVER (CONFIG)" of the OOM that took the fleet there
    when: str
    rung: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetUpdated(Event):
    """Our OOMs, or our memory model, are in the fleet's record at ``key`` (read, merged,
    compare-and-swapped)."""

    kind = "fleet_updated"
    key: str
    rung: float | None  # the fleet's rung after the merge
    fractions: tuple[float, ...]  # the fractions of the OOMs just added
    conflicts: int  # how many times another daemon wrote first and the merge was redone
    points: int = 0  # the memory model's points the record holds after the merge
    kept: float | None = None  # the highest fraction a climb kept past probation, per the record


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetError(Event):
    """The fleet's record could not be read or written, or the configuration's identity not
    read: supervision goes on without it; a write is retried (``retry_s``), a read is tried
    again at the next launch."""

    kind = "fleet_error"
    op: str  # read | write | version | gpu
    key: str
    error: str
    retry_s: float | None = None
    pending: int = 0  # our OOMs not yet in the record
