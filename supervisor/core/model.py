"""Value types shared by the pure core and the adapters.

Nothing here does I/O. Enums carry the attributes the policy needs, so a cause knows
whether a restart can fix it and which way it moves the memory fraction.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime


def rfc3339(when: datetime | float) -> str:
    """``2026-10-04T03:12:09.123Z``: RFC 3339 in UTC with a Z, from a datetime or a Unix time
    (the one way the daemon writes a wall-clock time: journal, alerts, state, launch lines)."""
    # A number is a Unix time; anything else is a datetime (of whatever class: a clock shifted
    # in a test, or by a library, makes its own subclass of it).
    ts = datetime.fromtimestamp(when, UTC) if isinstance(when, int | float) else when
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Remedy(enum.StrEnum):
    """What the policy does about a crash, before backoff is applied."""

    FRACTION_DOWN = "fraction_down"  # next rung down the mem_fraction_static ladder
    FRACTION_UP = "fraction_up"  # one rung up, never to a fraction that OOMed at runtime
    HICACHE_DOWN = "hicache_down"  # halve the hierarchical (host) cache
    CLEAR_GPU = "clear_gpu"  # kill what holds the GPU/port, then restart
    RESTART = "restart"  # plain restart with backoff
    GIVE_UP = "give_up"  # a restart cannot fix it: stop and call a human


class Cause(enum.StrEnum):
    """Why the server died. Values are the names used in logs, metrics and alerts."""

    remedy: Remedy
    summary: str

    def __new__(cls, value: str, remedy: Remedy, summary: str) -> Cause:
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.remedy = remedy
        obj.summary = summary
        return obj

    CUDA_OOM_RUNTIME = ("cuda_oom_runtime", Remedy.FRACTION_DOWN, "a CUDA OOM while serving")
    CUDA_OOM_STARTUP = ("cuda_oom_startup", Remedy.FRACTION_DOWN, "a CUDA OOM during startup")
    KV_POOL_TOO_SMALL = ("kv_pool_too_small", Remedy.FRACTION_UP, "a KV pool too small for the model")
    HOST_OOM = ("host_oom", Remedy.HICACHE_DOWN, "host memory exhaustion")
    NCCL_ERROR = ("nccl_error", Remedy.RESTART, "an NCCL/distributed error")
    CUDA_ERROR = ("cuda_error", Remedy.RESTART, "a CUDA error")
    GPU_HW_ERROR = ("gpu_hw_error", Remedy.GIVE_UP, "a GPU hardware/driver failure")
    PORT_IN_USE = ("port_in_use", Remedy.CLEAR_GPU, "its port already in use")
    MODEL_LOAD_ERROR = ("model_load_error", Remedy.GIVE_UP, "a model that cannot be loaded")
    CONFIG_ERROR = ("config_error", Remedy.GIVE_UP, "invalid server arguments")
    WATCHDOG_HANG = ("watchdog_hang", Remedy.RESTART, "SGLang's scheduler watchdog firing")
    OTHER = ("other", Remedy.RESTART, "an unrecognised error")
    HANG = ("hang", Remedy.RESTART, "failed health probes (a hang)")
    # Causes the daemon itself finds, not read from a crash log:
    HEADROOM_LOW = ("headroom_low", Remedy.FRACTION_DOWN, "too little GPU headroom after startup")
    GPU_MEMORY_STUCK = ("gpu_memory_stuck", Remedy.GIVE_UP, "GPU memory that never freed")
    STARTUP_TIMEOUT = ("startup_timeout", Remedy.RESTART, "a startup that took too long")
    PREFLIGHT_FAILED = ("preflight_failed", Remedy.RESTART, "a failed preflight check")
    OPERATOR_RESTART = ("operator_restart", Remedy.RESTART, "a restart an operator asked for")
    CLIMB = ("climb", Remedy.RESTART, "a climb to a higher fraction")

    @property
    def restartable(self) -> bool:
        return self.remedy is not Remedy.GIVE_UP

    @classmethod
    def parse(cls, value: str) -> Cause:
        """The member whose value is ``value`` (ValueError if none). ``Cause(value)`` does the
        same at run time, but a type checker reads that call against the member-building
        ``__new__`` above, which takes three arguments."""
        member = cls._value2member_map_.get(value)
        if not isinstance(member, cls):  # None: no member has that value (the narrowing is for mypy)
            raise ValueError(f"{value!r} is not a valid {cls.__name__}")  # noqa: TRY004 - a bad value, as Cause(value)
        return member


# The names the log classifier may return (issue 3); the rest are the daemon's own.
LOG_CAUSES: tuple[Cause, ...] = (
    Cause.CUDA_OOM_RUNTIME,
    Cause.CUDA_OOM_STARTUP,
    Cause.KV_POOL_TOO_SMALL,
    Cause.HOST_OOM,
    Cause.NCCL_ERROR,
    Cause.CUDA_ERROR,
    Cause.GPU_HW_ERROR,
    Cause.PORT_IN_USE,
    Cause.MODEL_LOAD_ERROR,
    Cause.CONFIG_ERROR,
    Cause.WATCHDOG_HANG,
    Cause.OTHER,
)


class Phase(enum.StrEnum):
    """Where the server was when it died, as the daemon saw it."""

    STARTING = "starting"  # launched, /health not yet 200
    SERVING = "serving"  # /health answered 200 at least once


class State(enum.StrEnum):
    """Supervisor states, in supervisord's vocabulary where it has a word."""

    STOPPED = "STOPPED"  # nothing running, nothing planned (initial, and after a clean stop)
    PREPARING = "PREPARING"  # clearing old processes, waiting for GPU memory, preflight
    STARTING = "STARTING"  # server launched, waiting for /health
    READY = "READY"  # serving; probes pass
    EXITED = "EXITED"  # the server died on its own; its crash log is being read
    RESTARTING = "RESTARTING"  # we are stopping the server in order to relaunch it
    BACKOFF = "BACKOFF"  # crashed; waiting out the restart delay
    STOPPING = "STOPPING"  # daemon shutdown: stopping the server for good
    GAVE_UP = "GAVE_UP"  # a restart cannot fix it or the crash budget is spent
    WAITING = "WAITING"  # a group node: waiting for the group's next generation ([group])


class JobKind(enum.StrEnum):
    """A requested transition of the server, in systemd's sense of a job: queued, run, then
    done or cancelled (``core.state.Job``). Who asks: an operator (restart), the daemon (stop),
    the core itself (a climb, a step-down, a recovery, the group's new generation)."""

    RESTART = "restart"  # an operator's planned restart: drained, relaunched at once, same flags
    CLIMB = "climb"  # drained, relaunched at once at a higher fraction (``Job.target``)
    STEP_DOWN = "step_down"  # too little headroom after start-up: drained, relaunched one rung lower
    RECOVER = "recover"  # a hang or a start that never ends: stopped, then a crash's backoff
    REGROUP = "regroup"  # [group]: the group's generation ended: stopped, then wait for the next
    STOP = "stop"  # the daemon stops the server for good
    HOLD = "hold"  # an operator's ``stop --server``: stopped and kept stopped, the daemon stays up
    START = "start"  # an operator's ``start --server``: a held server prepared and launched again

    @property
    def immediate(self) -> bool:
        """Relaunched at once when its stop is done (RESTARTING -> PREPARING): no backoff, no
        crash counted."""
        return self in (JobKind.RESTART, JobKind.CLIMB, JobKind.STEP_DOWN)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What a crash log says, read the way an experienced engineer reads it."""

    cause: Cause
    phase: Phase
    evidence: tuple[str, ...] = ()  # the line(s) that name the cause, stripped
    evidence_lineno: int | None = None  # 1-based line number in the tail of the first one
    exc_type: str | None = None  # e.g. "torch.OutOfMemoryError"
    exc_message: str | None = None
    location: str | None = None  # innermost frame, "deepseek_v2.py:2919 forward"
    rank: str | None = None  # "TP3" when the evidence line carries one
    # Set when the evidence calls for another remedy than the cause's default: a CUDA OOM
    # while loading weights (CLEAR_GPU: a lower fraction does not help) or a deterministic
    # CUDA error such as "no kernel image is available" (GIVE_UP).
    remedy_override: Remedy | None = None
    # The fraction SGLang itself names as the minimum ("Raise --mem-fraction-static above
    # 0.004"): a FRACTION_UP goes to the next rung above max(current, this).
    min_fraction: float | None = None
    # Certain: the evidence line names the cause and the phase is known or inferred from
    # markers. Uncertain: anything else; the daemon then acts only in the least harmful way
    # (restart unchanged, or one rung down for an OOM of unknown phase) and says so.
    certain: bool = True
    phase_source: str = ""  # "daemon", or what the phase was inferred from in the log
    runner_up: Cause | None = None  # the next reading when the margin is thin
    # What the reading rests on: "catalogue: <origin>" (the stack's own message),
    # "rule <name>: <source>" (a rule citing the line that prints it), "corpus rule <name>"
    # (a rule learned from logs only), "frames: <file:line func> (<subsystem>)" (new words,
    # read by the code that raised them), "site rule <n>" ([[diagnosis.rule]]), "signal"
    # (killed, no error logged), "" (nothing found).
    basis: str = ""
    # The crash's first error line, normalised (catalogue.normalise), when the reading is
    # `other` or uncertain: kept in the journal for a person, who may teach it as a site rule.
    unrecognised: str | None = None
    # "SIGKILL" when the process was killed by that signal after it was last ready and no
    # error was logged since: a local death of this rank, never an echo of a peer's.
    killed: str | None = None

    @property
    def remedy(self) -> Remedy:
        return self.remedy_override or self.cause.remedy

    def to_dict(self) -> dict[str, object]:
        return {
            "cause": str(self.cause),
            "phase": str(self.phase),
            "evidence": list(self.evidence),
            "evidence_lineno": self.evidence_lineno,
            "exc_type": self.exc_type,
            "exc_message": self.exc_message,
            "location": self.location,
            "rank": self.rank,
            "remedy": str(self.remedy),
            "min_fraction": self.min_fraction,
            "certain": self.certain,
            "phase_source": self.phase_source,
            "runner_up": None if self.runner_up is None else str(self.runner_up),
            "basis": self.basis,
            "unrecognised": self.unrecognised,
            "killed": self.killed,
        }


@dataclass(frozen=True, slots=True)
class SiteRule:
    """A site's own words for a cause (``[[diagnosis.rule]]``): tried before everything else.

    ``match`` is a bounded regex (``core.config`` checks it), searched in each line of the
    crash (case ignored); ``phase`` fixes the phase (None: read as usual); a site rule's
    reading is ``certain`` only when the site says so.
    """

    match: str
    cause: Cause
    phase: Phase | None = None
    certain: bool = False


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How the server's main process ended: exactly one of code/signal is set."""

    code: int | None = None
    signal: int | None = None

    @classmethod
    def from_returncode(cls, returncode: int) -> ExitStatus:
        return cls(signal=-returncode) if returncode < 0 else cls(code=returncode)

    def describe(self) -> str:
        if self.signal is not None:
            import signal as _signal

            try:
                return f"killed by {_signal.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        return f"exit code {self.code}"


@dataclass(frozen=True, slots=True)
class RankFacts:
    """Memory facts one rank printed while starting (None = not in the log)."""

    rank: str
    avail_mem_after_weights_gb: float | None = None
    weights_gb: float | None = None
    kv_cache_tokens: int | None = None
    kv_cache_gb: float | None = None
    avail_mem_after_pool_gb: float | None = None
    avail_mem_after_capture_gb: float | None = None
    max_total_num_tokens: int | None = None
    host_kv_pool_gb: float | None = None
    # Speculative decoding: the draft model's own "Load weight end", "KV Cache is allocated"
    # and "Memory pool end" lines, which come after the target model's on the same rank.
    draft_avail_mem_after_weights_gb: float | None = None
    draft_weights_gb: float | None = None
    draft_kv_cache_tokens: int | None = None
    draft_kv_cache_gb: float | None = None
    draft_avail_mem_after_pool_gb: float | None = None


@dataclass(frozen=True, slots=True)
class StartupFacts:
    """Per-rank startup facts plus the progress the log shows."""

    ranks: dict[str, RankFacts] = field(default_factory=dict)
    progress: str = "unknown"  # launching | loading_weights | kv_pool | capture | warmup | ready
    ready: bool = False
    # The mem_fraction_static SGLang chose, from its ``server_args=ServerArgs(...)`` line (so a
    # launch without the flag learns SGLang's own choice); None when not printed yet.
    mem_fraction_static: float | None = None

    @property
    def avail_mem_after_capture_gb(self) -> float | None:
        values = [r.avail_mem_after_capture_gb for r in self.ranks.values()]
        present = [v for v in values if v is not None]
        return min(present) if present else None

    @property
    def kv_cache_tokens(self) -> int | None:
        present = [r.kv_cache_tokens for r in self.ranks.values() if r.kv_cache_tokens is not None]
        return min(present) if present else None

    @property
    def max_total_num_tokens(self) -> int | None:
        present = [
            r.max_total_num_tokens for r in self.ranks.values() if r.max_total_num_tokens is not None
        ]
        return min(present) if present else None
