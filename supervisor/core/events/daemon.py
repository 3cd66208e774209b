"""The daemon's own events: its life, a group's, the links to the world (etcd, the broker, the router), its writes."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.core.events.base import Event, Json
from supervisor.core.model import Cause

# --- the daemon's life ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonStarted(Event):
    kind = "daemon_started"
    version: str
    config: str
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonStopping(Event):
    kind = "daemon_stopping"
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonFailed(Event):
    """A task of the daemon failed: it stops its server and exits non-zero for systemd."""

    kind = "daemon_failed"
    alert = "daemon_failed"
    severity = "critical"
    task: str
    error: str
    exit_code: int
    reexec: bool = False  # it re-executes in place instead (at most 3 times an hour), servers untouched


@dataclass(frozen=True, slots=True, kw_only=True)
class ReexecHandingOver(Event):
    """The old program's last word before its exec: the hand-over is written."""

    kind = "reexec_handing_over"
    reason: str
    pid: int
    servers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Reexecuted(Event):
    """The daemon re-executed itself in place (``reexec``, SIGUSR2, or a bug it survived):
    said by the new program, with the servers it adopted where they stood and those it could
    not (stopped as a planned stop would, then relaunched: ``relaunching``, with why)."""

    kind = "reexec"
    reason: str
    from_version: str
    version: str
    pid: int
    adopted: tuple[str, ...] = ()
    relaunching: tuple[str, ...] = ()
    why_not: str | None = None  # why a server was not adopted
    gap_s: float | None = None  # from the exec to the new program's first step


@dataclass(frozen=True, slots=True, kw_only=True)
class ReexecRefused(Event):
    """A re-exec was asked and refused (the new code fails its check, a step that cannot be
    cut, a group): the old daemon supervises on, its servers untouched."""

    kind = "reexec_refused"
    alert = "reexec_refused"
    severity = "warning"
    reason: str
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigReloaded(Event):
    kind = "config_reloaded"
    ok: bool
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartRequested(Event):
    """An operator's planned restart: drained, not counted as a crash."""

    kind = "restart_requested"
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RollingRestart(Event):
    """A step of ``restart``'s one-at-a-time pass over the servers: ``waiting`` (no other
    server serves yet), ``restart`` (this one is being restarted), ``stopped`` (it did not
    come back READY, so the rest are left alone), ``done``."""

    kind = "rolling_restart"
    step: str
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupJoined(Event):
    """[group]: this node registered in etcd (its lease and node key), at start and after
    every outage."""

    kind = "group_joined"
    group: str
    node_rank: int
    lease: str = ""  # its etcd lease id (hex): the same one after a re-exec in place


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLeader(Event):
    """[group]: this node's daemon leads the group now (elected in etcd)."""

    kind = "group_leader"
    group: str
    node_rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupGenerationEnded(Event):
    """[group] (the leader): generation ``number`` is over; every node stops its rank."""

    kind = "group_generation_ended"
    group: str
    number: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupGeneration(Event):
    """[group] (the leader): the next generation, decided once for the group from the root
    cause among the nodes' reports (``root_node`` None: none reported, a node was lost)."""

    kind = "group_generation"
    group: str
    number: int
    mem_fraction_static: float | None
    hicache_size_gb: int
    reason: str
    delay_s: float
    gave_up: bool
    root_node: int | None = None
    root_cause: Cause | None = None
    reports: tuple[Json, ...] = ()  # each node's cause and rank: what its own log said


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupEtcdUnreachable(Event):
    """[group]/[fleet]: etcd cannot be reached; the server keeps running, and nothing new
    (no generation, no relaunch) is started until etcd answers again. Once per outage."""

    kind = "group_etcd_unreachable"
    alert = "etcd_unreachable"
    severity = "warning"
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupEtcdRecovered(Event):
    kind = "group_etcd_recovered"
    down_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkDown(Event):
    """A link to a service of ours went down (``router``, ``fleet``; ``mqtt`` through the MQTT
    adapter's health hook; ``group`` says it with ``group_etcd_unreachable``): once per outage,
    however often it is retried (``supervisor.aio.Reconnect``)."""

    kind = "link_down"
    link: str  # group | router | fleet | mqtt
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkUp(Event):
    """The link answers again after ``down_s`` seconds of outage: once per outage (a link's
    first answer, with no outage before it, is no event; the MQTT adapter reports it to its
    health hook with ``down_s`` None)."""

    kind = "link_up"
    link: str
    down_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class StateWriteFailed(Event):
    """Once per episode; supervision goes on with the state in memory."""

    kind = "state_write_failed"
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLogWriteFailed(Event):
    """Once per episode; the in-memory tail still feeds the diagnosis."""

    kind = "server_log_write_failed"
    error: str
