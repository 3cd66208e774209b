"""The state machine's events: a launch, readiness, the memory model and the climb, a crash, a restart and its job, a give-up."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.core.events.base import Event, Json
from supervisor.core.model import Cause, JobKind, Phase, Remedy, State

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
    # What it runs on, for the report's header: the GPUs' names as the probe saw them before
    # the launch (one per GPU; none with backend "none" or a probe that failed), and the
    # SGLang version of the server's Python ("" when it could not be read).
    gpus: tuple[str, ...] = ()
    sglang_version: str = ""


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


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerHeld(Event):
    """An operator's ``stop --server``: the server is stopped and kept stopped (also after a
    daemon restart: ``at_boot``) until ``start``; the daemon stays up."""

    kind = "server_held"
    alert = "server_held"
    severity = "info"
    reason: str
    since: str  # RFC 3339: when the hold began
    at_boot: bool = False  # a daemon that started found the server held


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerReleased(Event):
    """An operator's ``start --server``: a held server is launched again."""

    kind = "server_released"
    alert = "server_released"
    severity = "info"
    reason: str
    held_since: str
