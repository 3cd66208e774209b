"""The daemon's outgoing events: one frozen dataclass per kind, one stream to every sink.

The pure core returns ``Emit(event)`` actions; the daemon stamps each event with ``host``
and ``instance`` and hands it to every ``EventSink`` (structlog logger, Prometheus metrics,
MQTT alerts). A sink's ``emit`` must never block and never raise: it is called on the event
loop, in the middle of a restart decision.

Inside, fields keep their types (``Cause``, ``Phase``, ``State``, tuples). Strings appear
only at the edge: ``event.fields()`` is the JSON-able form (enums as their values, tuples
as lists, ``from_`` as ``from``) that the log line, the metric labels and the MQTT payload
are made of. ``from_fields(kind, fields)`` is its inverse, for replaying a log line.

A class says what it is for: ``kind`` (its name in logs and metrics), ``alert`` (the MQTT
event kind, topic ``.../event/{alert}``, or None) with its ``severity``, and ``quiet`` (too
frequent for the info log). Adding an alert kind is one class here and one wording function
in ``supervisor/sinks/alerts.py`` (``WORDING``); ``tests/test_events.py`` holds both to it.

Log-only lines (not events): daemon_refused, reaper_started, reaper_unavailable, server_stopping,
metrics_listening, metrics_unavailable, task_failed, sink_failed, state_corrupt, state_unreadable,
journal_write_failed, gpu_ring_write_failed.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from supervisor.core.model import Cause, JobKind, Phase, Remedy, State

Json = dict[str, Any]  # a nested JSON-able record (a GPU reading, a check, a port holder...)

EVENTS: dict[str, type[Event]] = {}
"""Every event class by its ``kind``."""


def _edge(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_edge(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _edge(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One thing that happened. Subclasses add typed fields; construct them by keyword."""

    kind: ClassVar[str] = ""
    alert: ClassVar[str | None] = None  # the MQTT event kind, or None: not an alert
    severity: ClassVar[str] = ""  # info | warning | critical (alerts only)
    quiet: ClassVar[bool] = False  # too frequent for the info log (metrics still see it)

    host: str = ""  # stamped by the daemon
    instance: str = ""
    server: str = ""  # the server's name, with several [[server]] in one daemon

    def __init_subclass__(cls) -> None:
        # (no super() call: slots=True rebuilds the class, and the zero-argument form would
        # see the class it replaced; object's hook does nothing)
        if cls.kind:
            if cls.kind in EVENTS and EVENTS[cls.kind].__qualname__ != cls.__qualname__:
                raise TypeError(f"event kind {cls.kind!r} defined twice")
            EVENTS[cls.kind] = cls

    def fields(self) -> Json:
        """The edge form: JSON-able, enums as strings, ``from_`` as ``from``; without the
        stamp when it is empty."""
        out: Json = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("host", "instance", "server") and not value:
                continue
            out[f.name.rstrip("_")] = _edge(value)
        return out


def _parse(hint: object, value: object) -> object:
    """An edge value back to the field's type (enums, tuples); others as they are."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            if arm is type(None):
                continue
            return _parse(arm, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if origin is tuple and isinstance(value, list | tuple):
        (item, *_rest) = typing.get_args(hint) or (object,)
        return tuple(_parse(item, v) for v in value)
    return value


def from_fields(kind: str, fields: Mapping[str, Any]) -> Event:
    """The typed event for an edge form (``fields()``'s inverse). An unknown kind or field
    raises ``ValueError``."""
    cls = EVENTS.get(kind)
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name.rstrip("_"): f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - set(names)
    if unknown:
        raise ValueError(f"{kind}: unknown field(s) {sorted(unknown)}")
    values: dict[str, Any] = {names[k]: _parse(hints[names[k]], v) for k, v in fields.items()}
    return cls(**values)


class EventSink(Protocol):
    """Receives every event. Must not block and must not raise."""

    def emit(self, event: Event) -> None: ...


def alert_kinds() -> dict[str, str]:
    """Daemon event kind -> MQTT event kind, for every alerting event."""
    return {k: cls.alert for k, cls in EVENTS.items() if cls.alert}


def quiet_events() -> frozenset[str]:
    return frozenset(k for k, cls in EVENTS.items() if cls.quiet)


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


# --- the state machine -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StateChanged(Event):
    kind = "state_changed"
    from_: State
    to: State
    reason: str
    mem_fraction_static: float | None
    hicache_size_gb: float | None
    restarts: int
    last_cause: Cause | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLaunched(Event):
    kind = "launch"
    argv: tuple[str, ...]
    mem_fraction_static: float | None
    hicache_size_gb: float | None
    attempt: int
    pid: int
    rung: int | None
    launch_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerReady(Event):
    kind = "server_ready"
    startup_s: float
    mem_fraction_static: float | None
    hicache_size_gb: float | None
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovered(Event):
    """Serving again after a crash."""

    kind = "recovered"
    alert = "recovered"
    severity = "info"
    startup_s: float
    mem_fraction_static: float | None
    hicache_size_gb: float | None
    attempt: int
    cause: Cause
    mem_fraction_before: float | None  # the fraction it crashed at


@dataclass(frozen=True, slots=True, kw_only=True)
class Recommended(Event):
    """The memory model's recommended fraction changed (docs/capacity.md): ``fraction``
    None with what is ``missing``, or f* with its arithmetic in ``words``."""

    kind = "recommended_fraction"
    fraction: float | None
    mem_fraction_static: float | None  # the current one
    kv_tokens_now: int | None
    kv_tokens_at: int | None
    headroom_gb: float | None
    rank: str
    missing: str
    words: str
    points: int  # launches (distinct fractions) the model holds


@dataclass(frozen=True, slots=True, kw_only=True)
class KvPressureSeen(Event):
    """SGLang's KV pool ran short while serving (rate-limited: ``signals`` since the last
    one). Not a crash: the sign that a higher fraction would pay."""

    kind = "kv_pressure"
    source: str  # retraction | metrics
    detail: str
    signals: int
    mem_fraction_static: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Climbed(Event):
    """A planned, drained restart at a higher fraction ([policy] climb)."""

    kind = "climb"
    alert = "climb"
    severity = "info"
    mem_fraction_before: float | None
    mem_fraction_static: float
    kv_tokens_gain: float | None  # share: 0.19 is +19 %
    words: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ClimbFellBack(Event):
    """The higher fraction failed within its probation: back to the last stable one, which
    stays the ceiling for this model."""

    kind = "climb_fell_back"
    alert = "climb_fell_back"
    severity = "warning"
    mem_fraction_failed: float | None
    mem_fraction_static: float | None  # the last stable one, relaunched now
    cause: Cause


@dataclass(frozen=True, slots=True, kw_only=True)
class ClimbKept(Event):
    """The higher fraction served through its probation."""

    kind = "climb_kept"
    mem_fraction_static: float | None
    probation_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StartupFactsEvent(Event):
    kind = "startup_facts"
    ranks: dict[str, Json]
    avail_mem_after_capture_gb: float | None
    max_total_num_tokens: int | None
    kv_cache_tokens: int | None
    progress: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FractionLearned(Event):
    """SGLang chose the fraction (none was configured): read from its server_args."""

    kind = "fraction_learned"
    mem_fraction_static: float
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerDown(Event):
    """A process of the server's tree is seen dead, before the diagnosis."""

    kind = "server_down"
    alert = "down"
    severity = "warning"
    pid: int | None
    title: str  # "main" or sglang::...
    how: str
    phase: Phase
    mem_fraction_static: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Crash(Event):
    kind = "crash"
    alert = "crash"
    severity = "warning"
    cause: Cause
    remedy: Remedy
    phase: Phase
    exit_code: int | None
    signal: int | None
    evidence: tuple[str, ...]
    evidence_lineno: int | None
    location: str | None
    rank: str | None
    exc_type: str | None
    exc_message: str | None
    mem_fraction_static: float | None
    hicache_size_gb: float | None
    attempt: int
    next_mem_fraction_static: float | None
    next_hicache_size_gb: float | None
    next_retry_s: float | None  # None: giving up
    consecutive_failures: int
    certain: bool = True
    phase_source: str = ""
    runner_up: Cause | None = None
    min_fraction: float | None = None
    part_died: str | None = None
    log_cause: Cause | None = None  # on a hang or a requested restart, what the log said
    log_evidence: tuple[str, ...] = ()
    # What the reading rests on (Diagnosis.basis: "catalogue: ...", "rule NAME: ...", "site rule N: ...").
    basis: str = ""
    # The crash's first error line, normalised, when the reading is `other` or uncertain: the
    # report offers it to a person as a [[diagnosis.rule]] to paste (Diagnosis.unrecognised).
    unrecognised: str | None = None
    # "SIGKILL" when the main process was killed by that signal after it was ready and nothing
    # was logged since (Diagnosis.killed): a death from outside, said so.
    killed: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartScheduled(Event):
    kind = "restart_scheduled"
    alert = "restart"
    severity = "info"
    delay_s: float
    cause: Cause
    mem_fraction_static: float | None  # the next one
    hicache_size_gb: float | None
    attempt: int  # the next one
    rung: int | None
    mem_fraction_before: float | None  # the one that crashed (or was stopped)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobQueued(Event):
    """A requested transition was accepted (``core.state.Job``); it runs at once or when the
    server reaches a state it can run in."""

    kind = "job_queued"
    job: int
    job_type: JobKind
    cause: Cause | None
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobStarted(Event):
    kind = "job_started"
    job: int
    job_type: JobKind
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDone(Event):
    """The job did what it was for (a restart: its server stopped and the relaunch prepared;
    a stop: its server stopped). ``detail`` says how (``merged``: another job or launch did
    it)."""

    kind = "job_done"
    job: int
    job_type: JobKind
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCancelled(Event):
    kind = "job_cancelled"
    job: int
    job_type: JobKind
    by: str  # what superseded it (a stop, a give-up, a death)


@dataclass(frozen=True, slots=True, kw_only=True)
class GaveUp(Event):
    kind = "gave_up"
    alert = "gave_up"
    severity = "critical"
    reason: str
    cause: Cause | None
    mem_fraction_static: float | None
    restarts: int
    crashes: int  # the streak that ended here (0: it gave up without crashing)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadroomLow(Event):
    kind = "headroom_low"
    alert = "headroom_low"
    severity = "warning"
    avail_mem_gb: float
    threshold_gb: float
    rank: str
    action: str  # step_down | warn
    mem_fraction_static: float | None
    next_mem_fraction_static: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DailySummary(Event):
    """``[report] daily_at``: the last ``period_h`` hours in figures, once a day (docs/report.md)."""

    kind = "daily_summary"
    alert = "daily_summary"
    severity = "info"
    period_h: float
    state: str
    serving_pct: float
    crashes: int
    causes: tuple[str, ...]  # "cuda_oom_runtime x 1", most first
    lost_s: float  # to crashes and restarts
    mem_fraction_static: float | None  # at the start of the period
    next_mem_fraction_static: float | None  # now
    open_problems: tuple[str, ...]  # their MQTT alert kinds
    least_free_gb: float | None = None  # the least free GPU memory of any rank in the period


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightRetry(Event):
    """A retryable preflight/GPU failure, on backoff."""

    kind = "preflight_retry"
    cause: Cause
    detail: str
    delay_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Stable(Event):
    """READY long enough: the backoff streak is reset."""

    kind = "stable"
    after_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerStopped(Event):
    kind = "server_stopped"
    reason: str
    exit_code: int | None
    signal: int | None


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


ALERT_KINDS: dict[str, str] = alert_kinds()
QUIET_EVENTS: frozenset[str] = quiet_events()
