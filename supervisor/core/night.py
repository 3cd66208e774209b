"""The night in figures: what the morning report and the daily summary say, from the journal.

Pure: a function of the journal's records (the edge form of the daemon's events, each with
its wall time ``t``; ``supervisor/sinks/journal.py``), the window ``[start, end]`` and the
ladder's floor. No clock, no file: the caller reads the journal and hands in ``end``.

- ``bands``: the state the server was in, interval by interval (the last state before the
  window carries into it);
- ``serving_pct``: time READY over the window, less the time stopped on purpose;
- ``lost_crash_s`` / ``lost_restart_s``: from a death (the ``server_down`` before its crash
  record, else the crash) or a planned restart or headroom step-down to the next READY;
- ``crashes`` by cause, the crash and restart markers, the fraction's steps;
- per launch: its fraction, ``max_total_num_tokens`` and ``avail mem`` after CUDA-graph
  capture (the startup facts that followed it);
- ``open_problems``: the alert-worthy records still unresolved at ``end``, each as
  (MQTT alert kind, the record), for the alerts' own wording;
- the memory model's word (issue 25, docs/capacity.md): ``recommendation`` (the last
  ``recommended_fraction`` record), ``kv_pressure`` (the ``kv_pressure`` records summed up) and
  ``climbs`` (each ``climb``, ``climb_fell_back`` and ``climb_kept``, for the chart's markers
  and the report's words).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, time, timedelta, tzinfo
from typing import Any

Record = Mapping[str, Any]

SERVING = "READY"
IDLE = frozenset({"STOPPED", "STOPPING"})  # stopped on purpose: not counted against serving time
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 3600.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``12h``, ``90m``, ``2d``, ``3600s`` (a bare number is hours) -> seconds; ValueError else."""
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r}: not a duration (e.g. 12h, 90m, 2d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True, slots=True)
class Band:
    state: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Marker:
    t: float
    label: str
    fraction: float | None


@dataclass(frozen=True, slots=True)
class Launch:
    t: float
    attempt: int | None
    fraction: float | None
    max_total_num_tokens: int | None = None
    avail_mem_after_capture_gb: float | None = None


@dataclass(frozen=True, slots=True)
class Advice:
    """The memory model's recommended fraction, as its last ``recommended_fraction`` record
    said it: ``fraction`` with its arithmetic in ``words``, or None and what is ``missing``."""

    t: float
    fraction: float | None
    current: float | None  # the fraction running when it was said
    kv_tokens_now: int | None
    kv_tokens_at: int | None
    headroom_gb: float | None
    rank: str
    missing: str
    words: str

    @property
    def gain(self) -> float | None:
        """KV tokens at ``fraction`` over those now, as a share (0.19: +19 %)."""
        if self.kv_tokens_now and self.kv_tokens_at is not None:
            return self.kv_tokens_at / self.kv_tokens_now - 1
        return None

    @property
    def direction(self) -> str:
        """"raise", "keep" or "lower" the fraction; "" when there is none (or no current one)."""
        if self.fraction is None or self.current is None:
            return ""
        if abs(self.fraction - self.current) < 1e-9:
            return "keep"
        return "raise" if self.fraction > self.current else "lower"


@dataclass(frozen=True, slots=True)
class KvPressure:
    """SGLang's KV pool running short while serving, over the window (not a crash: the sign
    that a higher fraction would pay). ``signals`` sums the records' ``signals`` (each record
    counts those since the one before: they are told at most once a minute)."""

    signals: int
    by_source: tuple[tuple[str, int], ...]  # (retraction | metrics, signals), most first
    last_t: float
    last_source: str
    last_detail: str
    last_fraction: float | None


@dataclass(frozen=True, slots=True)
class ClimbStep:
    """A climb (``kind`` "climb": ``before`` -> ``fraction``, ``gain`` in KV tokens), its
    fall-back ("fell_back": ``before`` failed on probation of ``cause``, back to ``fraction``)
    or its keeping ("kept": ``fraction`` served through ``probation_s``)."""

    t: float
    kind: str
    fraction: float | None
    before: float | None = None
    gain: float | None = None
    cause: str | None = None
    probation_s: float | None = None


CLIMB_KINDS = {"climb": "climb", "climb_fell_back": "fell_back", "climb_kept": "kept"}


@dataclass(frozen=True, slots=True)
class Night:
    start: float
    end: float
    bands: tuple[Band, ...]
    state: str  # at the end
    serving_s: float
    lost_crash_s: float
    lost_restart_s: float
    crashes: tuple[tuple[str, int], ...]  # (cause, count), most first
    crash_markers: tuple[Marker, ...]
    restart_markers: tuple[Marker, ...]
    fraction_steps: tuple[tuple[float, float], ...]  # (t, fraction) at each launch
    fraction_start: float | None
    fraction_end: float | None
    floor: float | None
    launches: tuple[Launch, ...]
    open_problems: tuple[tuple[str, Record], ...] = field(default=())
    recommended: Advice | None = None
    kv_pressure: KvPressure | None = None
    climbs: tuple[ClimbStep, ...] = ()

    @property
    def span_s(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def shown_end(self) -> float:
        """Where a timeline ends: ``end``, or soon after the stop when the server was stopped
        on purpose (a demo, a daemon shut down for the day) rather than a long grey band."""
        if self.state in IDLE and self.bands and self.bands[-1].state in IDLE:
            last = self.bands[-1].start
            return min(self.end, last + max(0.04 * (last - self.start), 1.0))
        return self.end

    @property
    def supervised_s(self) -> float:
        """The window less the time the server was stopped on purpose (STOPPED, STOPPING)."""
        idle = sum(b.end - b.start for b in self.bands if b.state in IDLE)
        return max(self.span_s - idle, 0.0)

    @property
    def serving_pct(self) -> float:
        """Time READY over the time it was meant to serve (``supervised_s``)."""
        return 100.0 * self.serving_s / self.supervised_s if self.supervised_s > 0 else 0.0

    @property
    def crash_count(self) -> int:
        return sum(n for _, n in self.crashes)

    def kv_tokens_by_rung(self) -> tuple[tuple[float, int], ...]:
        """(fraction, max_total_num_tokens) for each fraction launched (the last reading)."""
        seen: dict[float, int] = {}
        for launch in self.launches:
            if launch.fraction is not None and launch.max_total_num_tokens is not None:
                seen[launch.fraction] = launch.max_total_num_tokens
        return tuple(sorted(seen.items(), reverse=True))


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opening(before: Iterable[Record]) -> tuple[str, float | None]:
    """The state and the fraction the records before the window leave: what carries into it."""
    state = "STOPPED"
    fraction: float | None = None
    for r in before:
        if r.get("kind") == "state_changed":
            state = str(r.get("to"))
        if r.get("kind") == "launch" and _num(r.get("mem_fraction_static")) is not None:
            fraction = _num(r.get("mem_fraction_static"))
    return state, fraction


@dataclass(slots=True)
class _Walk:
    """``summarize``'s reading of the window, record by record (``step``): the bands, the time
    lost, the markers, the fraction's steps and the launches as they come."""

    state: str
    band_start: float
    fraction: float | None
    fraction_start: float | None
    bands: list[Band] = field(default_factory=list)
    serving: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: {"crash": 0.0, "restart": 0.0})
    outage: tuple[str, float] | None = None  # (why, since) until the next READY
    crash_markers: list[Marker] = field(default_factory=list)
    restart_markers: list[Marker] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    causes: Counter[str] = field(default_factory=Counter)
    last_crash: Record | None = None
    down_since: float | None = None

    def close_band(self, t: float) -> None:
        if t > self.band_start:
            self.bands.append(Band(self.state, self.band_start, t))
            if self.state == SERVING:
                self.serving += t - self.band_start

    def step(self, r: Record) -> None:
        t, kind = float(r["t"]), r.get("kind")
        if kind == "state_changed":
            self._state_changed(t, r)
        elif kind == "server_down":
            self.down_since = t if self.down_since is None else self.down_since
        elif kind == "crash":
            self._crash(t, r)
        elif kind in ("restart_requested", "climb") or (kind == "headroom_low" and r.get("action") == "step_down"):
            if self.outage is None:
                self.outage = ("restart", t)
        elif kind == "restart_scheduled":
            if r.get("cause") != "climb":  # the climb's own marker says it
                self._restart_scheduled(t, r)
        elif kind == "launch":
            self._launch(t, r)
        elif kind == "fraction_learned":
            self._fraction_learned(t, r)
        elif kind == "startup_facts" and self.launches:
            self._startup_facts(r)

    def _state_changed(self, t: float, r: Record) -> None:
        self.close_band(t)
        self.state, self.band_start = str(r.get("to")), t
        if self.state == SERVING:
            self.down_since = None
        if self.state == SERVING and self.outage is not None:
            self.lost[self.outage[0]] += t - self.outage[1]
            self.outage = None

    def _crash(self, t: float, r: Record) -> None:
        # When it died (the server_down before the diagnosis), not when the log was read.
        died = self.down_since if self.down_since is not None else t
        self.down_since = None
        cause = str(r.get("cause"))
        self.causes[cause] += 1
        self.last_crash = r
        self.crash_markers.append(Marker(died, f"{cause} ({r.get('phase')})", _num(r.get("mem_fraction_static"))))
        if self.outage is None:
            self.outage = ("crash", died)

    def _restart_scheduled(self, t: float, r: Record) -> None:
        last_crash = self.last_crash
        planned = r.get("cause") is not None and (last_crash is None or r.get("cause") != last_crash.get("cause"))
        remedy = str(r.get("cause")) if planned else (
            str(last_crash.get("remedy")) if last_crash is not None else "restart")
        nxt = _num(r.get("mem_fraction_static"))
        label = f"{remedy}: restart at {nxt:g}" if nxt is not None else f"{remedy}: restart"
        self.restart_markers.append(Marker(t, label, nxt))

    def _launch(self, t: float, r: Record) -> None:
        self.fraction = _num(r.get("mem_fraction_static"))
        if self.fraction_start is None:
            self.fraction_start = self.fraction
        if self.fraction is not None:
            self.steps.append((t, self.fraction))
        self.launches.append(Launch(t, _int(r.get("attempt")), self.fraction))

    def _fraction_learned(self, t: float, r: Record) -> None:
        self.fraction = fraction = _num(r.get("mem_fraction_static"))
        launches = self.launches
        if launches and launches[-1].fraction is None and fraction is not None:
            launches[-1] = Launch(launches[-1].t, launches[-1].attempt, fraction)
            self.steps.append((t, fraction))
            self.fraction_start = self.fraction_start if self.fraction_start is not None else fraction

    def _startup_facts(self, r: Record) -> None:
        last = self.launches[-1]
        tokens = _int(r.get("max_total_num_tokens")) or last.max_total_num_tokens
        avail = _num(r.get("avail_mem_after_capture_gb"))
        self.launches[-1] = Launch(last.t, last.attempt, last.fraction, tokens,
                                   avail if avail is not None else last.avail_mem_after_capture_gb)


def summarize(records: Iterable[Record], *, start: float, end: float, floor: float | None) -> Night:
    """The night between ``start`` and ``end`` (epoch seconds) from the journal's records."""
    ordered = sorted((r for r in records if isinstance(r.get("t"), int | float)), key=lambda r: float(r["t"]))
    before = [r for r in ordered if r["t"] < start]
    inside = [r for r in ordered if start <= r["t"] <= end]
    if not before and inside:
        start = float(inside[0]["t"])  # the journal begins inside the window: the night starts there

    state, fraction = _opening(before)
    walk = _Walk(state=state, band_start=start, fraction=fraction, fraction_start=fraction)
    for r in inside:
        walk.step(r)
    walk.close_band(end)
    if walk.outage is not None:
        walk.lost[walk.outage[0]] += end - walk.outage[1]
    steps = walk.steps
    if walk.fraction_start is not None and steps and steps[0][0] > start:
        steps.insert(0, (start, walk.fraction_start))
    return Night(
        start=start, end=end, bands=tuple(walk.bands), state=walk.state, serving_s=walk.serving,
        lost_crash_s=walk.lost["crash"], lost_restart_s=walk.lost["restart"],
        crashes=tuple(walk.causes.most_common()), crash_markers=tuple(walk.crash_markers),
        restart_markers=tuple(walk.restart_markers), fraction_steps=tuple(steps),
        fraction_start=walk.fraction_start, fraction_end=walk.fraction, floor=floor, launches=tuple(walk.launches),
        open_problems=open_problems(ordered, walk.state),
        recommended=recommendation(ordered, end=end), kv_pressure=kv_pressure(inside), climbs=climbs(inside),
    )


# --- the memory model's word: the recommended fraction, KV pressure, climbs -----------------------


def recommendation(records: Iterable[Record], *, end: float) -> Advice | None:
    """The last ``recommended_fraction`` record at or before ``end``: the daemon says it when
    it changes (and at each READY), so the last one said still holds, even from before the
    window (its ``t`` says when). None when the daemon never said one."""
    said = [r for r in records
            if r.get("kind") == "recommended_fraction" and isinstance(r.get("t"), int | float) and r["t"] <= end]
    if not said:
        return None
    last = sorted(said, key=lambda r: float(r["t"]))[-1]  # stable: of equal times, the one written last
    return Advice(
        t=float(last["t"]), fraction=_num(last.get("fraction")), current=_num(last.get("mem_fraction_static")),
        kv_tokens_now=_int(last.get("kv_tokens_now")), kv_tokens_at=_int(last.get("kv_tokens_at")),
        headroom_gb=_num(last.get("headroom_gb")), rank=str(last.get("rank") or ""),
        missing=str(last.get("missing") or ""), words=str(last.get("words") or ""),
    )


def kv_pressure(records: Iterable[Record]) -> KvPressure | None:
    """The ``kv_pressure`` records summed up (a record without a count counts one); None when
    there were none."""
    seen = sorted((r for r in records if r.get("kind") == "kv_pressure" and isinstance(r.get("t"), int | float)),
                  key=lambda r: float(r["t"]))
    if not seen:
        return None
    by_source: Counter[str] = Counter()
    for r in seen:
        n = _int(r.get("signals"))
        by_source[str(r.get("source") or "unknown")] += n if n is not None and n > 0 else 1
    last = seen[-1]
    return KvPressure(
        signals=sum(by_source.values()), by_source=tuple(by_source.most_common()), last_t=float(last["t"]),
        last_source=str(last.get("source") or "unknown"), last_detail=str(last.get("detail") or ""),
        last_fraction=_num(last.get("mem_fraction_static")),
    )


def climbs(records: Iterable[Record]) -> tuple[ClimbStep, ...]:
    """Each climb, fall-back and climb kept, oldest first."""
    out: list[ClimbStep] = []
    for r in records:
        kind = CLIMB_KINDS.get(str(r.get("kind")))
        if kind is None or not isinstance(r.get("t"), int | float):
            continue
        t, fraction = float(r["t"]), _num(r.get("mem_fraction_static"))
        if kind == "climb":
            out.append(ClimbStep(t, kind, fraction, before=_num(r.get("mem_fraction_before")),
                                 gain=_num(r.get("kv_tokens_gain"))))
        elif kind == "fell_back":
            out.append(ClimbStep(t, kind, fraction, before=_num(r.get("mem_fraction_failed")),
                                 cause=str(r["cause"]) if r.get("cause") else None))
        else:
            out.append(ClimbStep(t, kind, fraction, probation_s=_num(r.get("probation_s"))))
    return tuple(sorted(out, key=lambda c: c.t))


# What resolves an open problem: a later record of one of these kinds.
_RESOLVED_BY: dict[str, tuple[str, ...]] = {
    "gave_up": ("launch",),
    "gpu_memory_stuck": ("launch",),
    "port_in_use": ("launch",),
    "daemon_failed": ("daemon_started",),
    "group_etcd_unreachable": ("group_etcd_recovered",),
    "headroom_low": ("launch",),
}
_ALERT = {"gave_up": "gave_up", "gpu_memory_stuck": "gpu_memory_stuck", "port_in_use": "port_in_use",
          "daemon_failed": "daemon_failed", "group_etcd_unreachable": "etcd_unreachable",
          "headroom_low": "headroom_low", "crash": "crash"}


def open_problems(records: Sequence[Record], state: str) -> tuple[tuple[str, Record], ...]:
    """The alerts still true at the end, oldest first, one per kind: a give-up, stuck GPU
    memory, a foreign port holder, a daemon failure, etcd away, or a headroom warning not
    followed by the launch that would fix them; and a crash while the server is still not
    serving (in BACKOFF, say)."""
    latest: dict[str, Record] = {}
    for r in records:
        kind = str(r.get("kind"))
        if kind in _RESOLVED_BY and not (kind == "headroom_low" and r.get("action") == "step_down"):
            latest[kind] = r
        for open_kind, resolvers in _RESOLVED_BY.items():
            if kind in resolvers and open_kind in latest and float(r["t"]) >= float(latest[open_kind]["t"]):
                del latest[open_kind]
        if kind == "crash":
            latest["crash"] = r
        if kind == "state_changed" and r.get("to") == SERVING:
            latest.pop("crash", None)
    if state in (SERVING, "STOPPED"):
        latest.pop("crash", None)
    if "gave_up" in latest:
        latest.pop("crash", None)  # the give-up says it
    found = sorted(latest.items(), key=lambda kv: float(kv[1]["t"]))
    return tuple((_ALERT[kind], r) for kind, r in found)


# --- the daily summary's schedule -----------------------------------------------------------------


def parse_time_of_day(text: str) -> time:
    """``"08:30"`` -> 08:30; ValueError for anything else."""
    hh, sep, mm = text.partition(":")
    if not sep or not hh.isdigit() or not mm.isdigit() or len(mm) != 2:
        raise ValueError(f"{text!r}: not HH:MM")
    return time(int(hh), int(mm))


def next_daily(now: datetime, at: time, tz: tzinfo) -> datetime:
    """The first ``at`` (local wall time in ``tz``) strictly after ``now`` (aware), as an aware
    datetime in ``tz``. Across a DST change it is still ``at`` on the wall clock: 23 or 25
    hours after the previous one. A time that does not exist that day (skipped by a spring
    change) is taken as the same wall time after the gap (fold semantics of zoneinfo: 02:30
    on a day that jumps 02:00 -> 03:00 is 03:30)."""
    day = now.astimezone(tz).date()
    for _ in range(3):
        # A wall time in a gap has no instant of its own; timestamp() gives it the offset in
        # force before the gap (PEP 495, fold=0), which lands it that far after the gap.
        instant = datetime.combine(day, at, tzinfo=tz).timestamp()
        if instant > now.timestamp():
            return datetime.fromtimestamp(instant, tz)
        day += timedelta(days=1)
    raise AssertionError("unreachable: a day later is always after now")
