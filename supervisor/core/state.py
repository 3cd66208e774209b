"""The core's state and its JSON form: what the machine holds (``Core``) and what it has
learned and keeps across restarts of the daemon (``Learned``: the fraction, the crash
history, the fleet's lessons), with the timers it may have set."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from supervisor.core.capacity import MemoryModel, Recommendation, recommend
from supervisor.core.config import Config
from supervisor.core.fleet import FleetOom
from supervisor.core.model import Cause, JobKind, Phase, Remedy, StartupFacts, State

HISTORY_LIMIT = 200
FLEET_PENDING_LIMIT = 50  # lessons kept for the fleet while etcd is away; the rung is kept anyway


class Timer(enum.StrEnum):
    """The core's timers. An enum, so that a misspelt name fails where it is written instead
    of falling through ``step`` as an event that means nothing."""

    PROBE = "probe"  # next health probe (startup poll, or the fixed rate while serving)
    STARTUP = "startup"  # the hard cap on a start
    SILENCE = "silence"  # a start that printed nothing for too long
    BACKOFF = "backoff"  # the restart delay after a crash
    STABLE = "stable"  # serving long enough to forget the crash streak
    PROBATION = "probation"  # a climb's higher fraction served long enough to keep it


# --- learned state (persisted) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CrashRecord:
    """One line of the crash history, as shown by ``status``."""

    wall_time: str  # RFC 3339, for people
    cause: Cause
    remedy: Remedy
    phase: Phase
    exit: str  # "killed by SIGKILL", "exit code 1", "stopped by us"
    fraction: float | None  # None: SGLang's own choice, not read from its log
    next_fraction: float | None
    evidence: str
    location: str | None
    attempt: int
    # A relaunch the daemon made on purpose (an operator's restart, a climb, a step-down for
    # headroom): kept in the history, never counted as a crash.
    planned: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON form in state.json: enums as their string values."""
        d = dataclasses.asdict(self)
        d.update(cause=str(self.cause), remedy=str(self.remedy), phase=str(self.phase))
        if not self.planned:
            del d["planned"]  # a crash's line is as it always was
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CrashRecord:
        """Back from JSON. A value this version does not know (a state file written by a newer
        one) reads as ``other`` / ``restart`` / ``starting``: one history line loses its
        detail, while the rung and the fractions that ran out of memory are kept."""
        typed = {
            "cause": _member(Cause.parse, d["cause"], Cause.OTHER),
            "remedy": _member(Remedy, d["remedy"], Remedy.RESTART),
            "phase": _member(Phase, d["phase"], Phase.STARTING),
        }
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in known}, **typed})


_E = TypeVar("_E", Cause, Remedy, Phase)


def _member(parse: Callable[[str], _E], value: str, default: _E) -> _E:
    try:
        return parse(value)
    except ValueError:
        return default


@dataclass(frozen=True, slots=True)
class FleetNote:
    """What the fleet's record said the last time it was read for this server (docs/fleet.md):
    its rung, where and when it was reached, the fractions that ran out of memory there, and
    whether the fleet lowered our own rung (from ``own_fraction``, at ``applied_at``)."""

    key: str
    fraction: float  # the fleet's rung (our floor, if the fleet's went below it)
    source: str  # "HOST/SERVER (CONFIG)" of the OOM that took the fleet there
    when: str  # that OOM's wall time
    oom_fractions: tuple[float, ...] = ()
    own_fraction: float | None = None  # our rung before the fleet's was applied
    applied: bool = False
    applied_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["oom_fractions"] = list(self.oom_fractions)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FleetNote:
        own = d.get("own_fraction")
        return cls(
            key=str(d["key"]), fraction=float(d["fraction"]), source=str(d.get("source", "")),
            when=str(d.get("when", "")), oom_fractions=tuple(float(x) for x in d.get("oom_fractions", [])),
            own_fraction=None if own is None else float(own), applied=bool(d.get("applied", False)),
            applied_at=str(d.get("applied_at", "")),
        )


@dataclass(frozen=True, slots=True)
class Learned:
    """What survives a daemon restart: the rung, what crashed, the history; with ``[fleet]``
    also the lessons not yet written to the fleet's record and what the fleet last said."""

    # None: not set by us, SGLang chooses (the flag is left out) until its server_args line
    # says what it chose; from then on the ladder steps from that value.
    fraction: float | None
    hicache_size_gb: int
    base_fraction: float | None  # the configured fraction this was learned from (None = SGLang's)
    base_hicache_size_gb: int
    oom_fractions: frozenset[float] = frozenset()
    history: tuple[CrashRecord, ...] = ()
    restarts: int = 0
    fleet_pending: tuple[FleetOom, ...] = ()  # OOMs the fleet's record does not hold yet
    fleet: FleetNote | None = None
    capacity: MemoryModel = MemoryModel()  # what launches showed of memory (core.capacity)

    @property
    def ceiling_fractions(self) -> frozenset[float]:
        """Fractions the ladder never climbs back to: ours that ran out of CUDA memory, and the
        fleet's (the same configuration on the same GPU ran out there)."""
        return self.oom_fractions | frozenset(self.fleet.oom_fractions if self.fleet else ())

    @property
    def kept_fraction(self) -> float | None:
        """The highest fraction a climb kept past its probation (here or, with ``[fleet]``,
        elsewhere in the fleet), while nothing at or below it ran out of memory since."""
        kept = self.capacity.kept
        if kept is None or any(c <= kept + 1e-9 for c in self.ceiling_fractions):
            return None
        return kept

    def recommendation(self, cfg: Config) -> Recommendation:
        """The memory model's recommended fraction for this config (docs/capacity.md)."""
        p = cfg.policy
        return recommend(
            self.capacity, current=self.fraction, floor_gb=cfg.gpu.headroom_min_gb + p.climb_margin_gb,
            step=p.climb_step, ceiling=p.climb_ceiling or p.fraction_ladder[0], out_of_memory=self.ceiling_fractions,
        )

    @classmethod
    def initial(cls, cfg: Config) -> Learned:
        base = cfg.server.mem_fraction_static
        return cls(base, cfg.server.hicache_size_gb, base, cfg.server.hicache_size_gb)

    def rebased(self, cfg: Config) -> Learned:
        """Keep what was learned unless the operator changed the configured starting point."""
        fresh = Learned.initial(cfg)
        if (fresh.base_fraction, fresh.base_hicache_size_gb) == (
            self.base_fraction,
            self.base_hicache_size_gb,
        ):
            return self
        return replace(
            fresh, oom_fractions=self.oom_fractions, history=self.history, restarts=self.restarts,
            fleet_pending=self.fleet_pending, capacity=self.capacity,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["oom_fractions"] = sorted(self.oom_fractions, reverse=True)
        d["history"] = [h.to_dict() for h in self.history]
        # Fleet memory's keys only when it has something to say: a daemon without [fleet]
        # writes the same state file as before it existed.
        d.pop("fleet_pending", None)
        d.pop("fleet", None)
        d.pop("capacity", None)
        if self.capacity.points or self.capacity.kept is not None:
            d["capacity"] = self.capacity.to_dict()
        if self.fleet_pending:
            d["fleet_pending"] = [{**o.to_dict(), "key": o.key} for o in self.fleet_pending]
        if self.fleet is not None:
            d["fleet"] = self.fleet.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Learned:
        return cls(
            fraction=None if d["fraction"] is None else float(d["fraction"]),
            hicache_size_gb=int(d["hicache_size_gb"]),
            base_fraction=None if d["base_fraction"] is None else float(d["base_fraction"]),
            base_hicache_size_gb=int(d["base_hicache_size_gb"]),
            oom_fractions=frozenset(float(x) for x in d.get("oom_fractions", [])),
            history=tuple(CrashRecord.from_dict(h) for h in d.get("history", [])),
            restarts=int(d.get("restarts", 0)),
            fleet_pending=tuple(FleetOom.from_dict(o) for o in d.get("fleet_pending", [])),
            fleet=None if not d.get("fleet") else FleetNote.from_dict(d["fleet"]),
            capacity=MemoryModel.from_dict(d["capacity"]) if d.get("capacity") else MemoryModel(),
        )


@dataclass(frozen=True, slots=True)
class Hold:
    """An operator's ``stop --server``: why and since when (RFC 3339) the server is kept
    stopped, until ``start``. Persisted: a daemon restart keeps it stopped."""

    reason: str
    since: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> Hold | None:
        if not isinstance(d, dict) or not isinstance(d.get("reason"), str):
            return None
        return cls(d["reason"], str(d.get("since", "")))


@dataclass(frozen=True, slots=True)
class GiveUpNote:
    """Why the server was given up, kept in the state file until it serves again: what
    ``status`` shows after any later stop (the state then says only STOPPED)."""

    wall_time: str
    reason: str
    cause: str | None
    evidence: str
    command: tuple[str, ...]  # the last launch's argv (empty: none ran)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["command"] = list(self.command)
        return d

    @classmethod
    def from_dict(cls, d: object) -> GiveUpNote | None:
        if not isinstance(d, dict) or not isinstance(d.get("reason"), str):
            return None
        cause = d.get("cause")
        return cls(str(d.get("wall_time", "")), d["reason"], cause if isinstance(cause, str) else None,
                   str(d.get("evidence", "")), tuple(str(a) for a in d.get("command") or ()))


# --- the machine's state ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """What one launch has, and only while it lives: a launch replaces the whole record
    (``Run(attempt=n + 1, launched_at=now)``), so nothing of the last one leaks into it."""

    attempt: int = 0  # this launch's number since the daemon started (0: none yet)
    pid: int | None = None
    launched_at: float | None = None  # monotonic
    ready_at: float | None = None  # monotonic; set at READY
    probe_failures: int = 0  # in a row, while READY
    headroom_checked: bool = False  # the headroom guard ran for this launch
    facts: StartupFacts | None = None  # what its start-up lines said
    part_died: str = ""  # "sglang::scheduler (pid 12)": a process of the tree that died first
    recommendation_told: bool = False  # the recommendation went out since the launch
    kv_queue: int | None = None  # SGLang's queue at the last /metrics reading
    argv: tuple[str, ...] = ()  # what was launched


@dataclass(frozen=True, slots=True)
class Job:
    """A requested transition (``JobKind``), in systemd's sense: queued, run, then done or
    cancelled, each with its event (``JobQueued``, ``JobStarted``, ``JobDone``,
    ``JobCancelled``). One runs at a time (``Core.job``); one more may wait (``Core.queued``)."""

    id: int
    kind: JobKind
    cause: Cause | None  # what the crash history and the events call it (operator_restart, climb, hang...; a stop: None)
    detail: str  # why, in words
    target: float | None = None  # CLIMB: the fraction it climbs to


@dataclass(frozen=True, slots=True)
class Core:
    state: State
    learned: Learned
    run: Run = Run()  # the launch that runs (or ran last)
    job: Job | None = None  # the requested transition under way
    queued: Job | None = None  # one more, waiting for the state it can run in
    jobs: int = 0  # jobs made since the daemon started (their ids)
    failures: int = 0  # crash streak (resets after a stable period)
    crash_times: tuple[float, ...] = ()  # monotonic, for the give-up window
    last_cause: Cause | None = None
    recovering_from: Cause | None = None  # cause of the crash the next ready recovers from
    reason: str = ""  # why the last transition happened (status, gave-up reason)
    generation: int = 0  # [group]: the group generation this node runs (or last ran)
    fleet_key: str = ""  # the fleet key of the configuration being launched ("" = not known)
    # KV pressure while serving (monotonic times): the last signal, signals not yet told,
    # when the last kv_pressure event went out.
    kv_pressure_at: float | None = None
    kv_signals: int = 0
    kv_told_at: float | None = None
    # The climb ([policy] climb): when the last one began, and the last stable fraction while
    # the higher one is on probation (its target is the CLIMB job's).
    climb_at: float | None = None
    climb_from: float | None = None
    # Persisted beside ``learned`` (the state file): an operator's hold, and the last give-up
    # (until the server serves again).
    held: Hold | None = None
    gave_up: GiveUpNote | None = None

    @classmethod
    def initial(cls, learned: Learned, *, held: Hold | None = None, gave_up: GiveUpNote | None = None) -> Core:
        return cls(State.STOPPED, learned, held=held, gave_up=gave_up)

    @property
    def pid(self) -> int | None:
        return self.run.pid

    @property
    def attempt(self) -> int:
        return self.run.attempt

    @property
    def phase(self) -> Phase:
        served = self.state is State.READY or self.run.ready_at is not None
        return Phase.SERVING if served else Phase.STARTING
