"""Prometheus metrics: an ``EventSink`` that turns the daemon's events into metrics.

Every metric is derived from the events of ``supervisor.core.events`` (the field names there are
the contract), except two config values given at construction (the ladder's floor, the
headroom minimum) that the alert rules compare against. Metrics live in an injected
``CollectorRegistry`` (never the global one), named ``sglang_supervisor_*`` in base units.
Labels are bounded: a crash cause (the ``Cause`` values, every one pre-initialised to 0 so
``increase()`` works from the first crash), a supervisor state, a GPU index + UUID (named
``gpu`` and ``UUID`` like DCGM exporter's, so the two join ``on(UUID)``), a rank ("TP0"),
an alert kind, the host name. Never a pid, a path or a message. ``rank_gpu_info`` ties each
rank to its GPU (``rank_gpus``), so DCGM exporter's series join the supervisor's ranks.

The endpoint that serves them is ``supervisor.sinks.metrics_endpoint``; ``emit`` only
updates in-memory values, so it cannot delay a restart decision.

What SGLang exports itself with ``--enable-metrics`` (``sglang:*``: queue, throughput,
token usage, latency) is not duplicated here; see docs/metrics.md for scraping both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from supervisor import __version__
from supervisor.core.capacity import rank_gpus
from supervisor.core.events import (
    ALERT_KINDS,
    Climbed,
    ClimbFellBack,
    ClimbKept,
    ConfigReloaded,
    Crash,
    DaemonFailed,
    Event,
    FleetApplied,
    FleetError,
    FleetUpdated,
    ForeignGpuProcess,
    FractionLearned,
    GaveUp,
    GpuLowFree,
    GpuMemoryStuck,
    GpuProbeFailed,
    GpuSample,
    GroupEtcdRecovered,
    GroupEtcdUnreachable,
    GroupGeneration,
    GroupGenerationEnded,
    GroupJoined,
    GroupLeader,
    HeadroomLow,
    InheritedServer,
    Json,
    KvPressureSeen,
    LinkDown,
    LinkUp,
    OrphansKilled,
    OrphansReaped,
    PortInUse,
    PreflightFailed,
    ProbeAnswered,
    Recommended,
    Recovered,
    ReexecRefused,
    Reexecuted,
    RestartRequested,
    RestartScheduled,
    RouterCallFailed,
    RouterRegistered,
    RouterRemoved,
    ServerDown,
    ServerHeld,
    ServerLaunched,
    ServerReady,
    ServerReleased,
    ServerStopped,
    StartupFactsEvent,
    StateChanged,
)
from supervisor.core.model import Cause, State

KV_PRESSURE_SOURCES = ("retraction", "refused", "metrics")  # core.messages.KvPressure's sources
CLIMB_OUTCOMES = ("climbed", "fell_back", "kept")
PREFIX = "sglang_supervisor"
GIB = 1024**3  # SGLang prints GPU memory ("avail mem=0.82 GB") in GiB (x / (1 << 30))
HICACHE_GB = 10**9  # --hicache-size is in decimal GB (SGLang multiplies it by 1e9)
NAN = math.nan

# Seconds. A big model loads for 10-30 min, the simulator for a few seconds.
STARTUP_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 900, 1200, 1800, 2700, 3600)
# Seconds. A healthy SGLang /health runs a 1-token generation (~1 s); its own timeout is 20 s.
PROBE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0)

# Events counted in sglang_supervisor_events_total{event} (their kind): rare and worth a glance.
COUNTED: tuple[type[Event], ...] = (
    OrphansKilled,
    InheritedServer,
    OrphansReaped,
    ForeignGpuProcess,
    PreflightFailed,
    HeadroomLow,
    GpuMemoryStuck,
    GpuLowFree,
    ServerStopped,
    ServerHeld,
    ServerReleased,
    ConfigReloaded,
    ServerDown,
    PortInUse,
    RestartRequested,
    FractionLearned,
    GroupGenerationEnded,
    GroupEtcdUnreachable,
    FleetApplied,
    FleetUpdated,
    FleetError,
    DaemonFailed,
    Reexecuted,
    ReexecRefused,
)
COUNTED_EVENTS = tuple(cls.kind for cls in COUNTED)  # the label values
LINKS = ("group", "router", "fleet", "mqtt")  # supervisor.aio.Reconnect's links
ROUTER_OPS = ("add", "remove", "list")  # supervisor.services.routing
ROUTER_REMOVE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PROBE_FAILURE_REASONS = ("http_status", "no_response")  # an answer that is not 200 / none
MQTT_FAILURE_REASONS = ("auth", "config", "tls", "timeout", "error")  # supervisor.adapters.mqtt.failure
ALERT_KIND_LABELS = (*sorted(set(ALERT_KINDS.values())), "other")

log = structlog.get_logger(__name__)

def _number(value: object) -> float | None:
    """A finite float from an event field, or None (absent, null, garbage)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _gauge_value(value: object, scale: float = 1.0) -> float:
    """An event field as a gauge value: NaN when unknown, so comparisons are false."""
    number = _number(value)
    return NAN if number is None else number * scale


@dataclass(frozen=True, slots=True)
class _Families:
    """Declares metric families in one registry, named ``sglang_supervisor_*``."""

    registry: CollectorRegistry

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(f"{PREFIX}_{name}", doc, list(labels), registry=self.registry)

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(f"{PREFIX}_{name}", doc, list(labels), registry=self.registry)


class Metrics:
    """The daemon's Prometheus metrics, fed by events; implements ``EventSink``.

    ``emit`` never raises and never blocks; it reads the typed events of
    ``supervisor.core.events`` (anything else is ignored). The MQTT adapter's own reports
    (an alert sent or dropped, the broker connected or refused) come through
    ``alerting_health(kind, value)``, its ``on_health`` hook.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.time,
        fraction_ladder: Sequence[float] = (),
        headroom_min_gb: float | None = None,
        hostname: str = "",
        gpu_indices: Sequence[int] = (),
    ) -> None:
        self._clock = clock  # wall clock: only for the last-crash timestamp
        # rank_gpu_info: the host (DCGM's Hostname label) and [gpu] indices, the server's GPUs
        # in CUDA_VISIBLE_DEVICES order; without them, the order of the GPU sample.
        self._hostname = hostname
        self._gpu_indices = tuple(str(i) for i in gpu_indices)
        # What only this sink joins, across events that each carry one side of it (no event
        # says it whole, and the core has no use for it):
        # - rank_gpu_info joins the ranks of startup_facts with the GPUs of gpu_sample, which
        #   come at their own times and in either order;
        self._sampled: tuple[str, ...] = ()  # GPU indices of the last sample, in its order
        self._uuids: dict[str, str] = {}  # GPU index -> UUID, from the samples
        self._rank_gpus: dict[str, int] = {}  # rank -> position among the server's GPUs (the run's)
        self._rank_gpu_shown: dict[str, dict[str, str]] = {}  # rank -> its exported labels (a series changes only when they do)
        # - server_up is READY (the last state_changed) and the last probe passed: a probe
        #   does not carry the state, a state change not the probe's answer.
        self._state: State = State.STOPPED
        self._probe_ok = False

        families = _Families(registry)
        self._declare_server(families)
        self._declare_gpus(families)
        self._declare_links(families)
        self._declare_memory_model(families)
        self._preset()
        self._set_ladder(fraction_ladder)
        self.headroom_min.set(_gauge_value(headroom_min_gb, GIB))
        self._set_state(State.STOPPED)

    # -- the families ------------------------------------------------------------------

    def _declare_server(self, f: _Families) -> None:
        """The server and the supervisor: state, crashes and restarts, memory settings, timings."""
        self.build_info = Info(f"{PREFIX}_build", "The supervisor's version.", registry=f.registry)
        self.build_info.info({"version": __version__})
        # Server and supervisor state.
        self.server_up = f.gauge("server_up", "1 when the SGLang server is READY and its last health probe passed, else 0.")
        self.state = f.gauge("state", "The supervisor state: 1 for the current one, 0 for the others.", ["state"])
        self.gave_up = f.gauge("gave_up", "1 when the supervisor gave up restarting the server and waits for a human.")
        self.held = f.gauge("held", "1 while an operator's 'stop' keeps the server stopped (maintenance), until 'start'.")
        self.launches = f.counter("launches", "Server launches (the first one and every restart).")
        # Crashes and restarts.
        self.crashes = f.counter("crashes", "Server crashes by diagnosed cause.", ["cause"])
        self.restarts = f.counter("restarts", "Restarts scheduled by the cause of the crash that led to them.", ["cause"])
        self.last_crash = f.gauge("last_crash_timestamp_seconds", "Unix time of the last crash (0 = none since the supervisor started).")
        self.consecutive_failures = f.gauge("consecutive_failures", "Crashes in a row as of the last crash; 0 once the server is ready again.")
        self.backoff_delay = f.gauge("backoff_delay_seconds", "Delay before the scheduled restart while waiting it out, else 0.")
        # The memory settings the supervisor chose.
        self.fraction = f.gauge("mem_fraction_static", "--mem-fraction-static of the current launch (NaN = left to SGLang).")
        self.fraction_floor = f.gauge("mem_fraction_static_floor", "The lowest rung of the configured mem_fraction_static ladder (NaN = unknown).")
        self.ladder_rung = f.gauge("mem_fraction_ladder_rung", "0-based ladder rung of the current launch's fraction (NaN = off the ladder).")
        self.hicache = f.gauge("hicache_size_bytes", "--hicache-size of the current launch, host memory per TP rank (0 = off).")
        self.headroom_min = f.gauge("headroom_min_bytes", "Configured minimum GPU headroom after CUDA-graph capture (NaN = unknown).")
        # Timings.
        self.startup_duration = Histogram(
            f"{PREFIX}_startup_duration_seconds", "Time from launch to the first healthy answer.",
            buckets=STARTUP_BUCKETS, registry=f.registry,
        )
        self.probe_duration = Histogram(
            f"{PREFIX}_health_probe_duration_seconds", "Duration of health probes of a started server.",
            buckets=PROBE_BUCKETS, registry=f.registry,
        )
        self.probe_failures = f.counter(
            "health_probe_failures", "Failed health probes of a started server, by reason (http_status | no_response).", ["reason"],
        )

    def _declare_gpus(self, f: _Families) -> None:
        """GPUs and ranks."""
        gpu_labels = ("gpu", "UUID")  # DCGM exporter's label names: join on(UUID)
        self.gpu_total = f.gauge("gpu_memory_total_bytes", "Total memory of each GPU.", gpu_labels)
        self.gpu_free = f.gauge("gpu_memory_free_bytes", "Free memory of each GPU at the last sample.", gpu_labels)
        self.gpu_probe_errors = f.counter("gpu_probe_errors", "Failed GPU memory samples (NVML or simulated backend).")
        self.gpu_memory_stuck = f.gauge("gpu_memory_stuck", "1 when GPU memory did not free after the server died, until the next launch.")
        rank_facts = {
            "avail_mem_after_capture_gb": ("rank_avail_memory_after_capture_bytes", "GPU memory a rank had left after CUDA-graph capture (headroom for activations).", GIB),
            "max_total_num_tokens": ("rank_max_total_num_tokens", "KV capacity of a rank (max_total_num_tokens from its startup log).", 1.0),
            "weights_gb": ("rank_weights_bytes", "GPU memory a rank used for the weights.", GIB),
            "kv_cache_gb": ("rank_kv_cache_bytes", "GPU memory of a rank's KV cache pool.", GIB),
        }
        self._rank_gauges = {
            key: (f.gauge(name, doc + " Current run only.", ["rank"]), scale)
            for key, (name, doc, scale) in rank_facts.items()
        }
        self.rank_gpu = Info(
            f"{PREFIX}_rank_gpu",
            "The GPU a rank runs on, with DCGM exporter's labels (gpu, UUID, Hostname/hostname) to join"
            " its series on(UUID). Current run only.",
            ["rank"], registry=f.registry,
        )

    def _declare_links(self, f: _Families) -> None:
        """Alerting health, notable events, the router, a group, the reconnected links."""
        self.alerts_sent = f.counter("alerts_sent", "Alerts delivered to the MQTT broker, by kind.", ["kind"])
        self.alerts_dropped = f.counter("alerts_dropped", "Alerts dropped (outbox full or undeliverable), by kind.", ["kind"])
        self.mqtt_connected = f.gauge("mqtt_connected", "1 when connected to the MQTT broker, 0 when not (NaN = MQTT not reporting).")
        self.mqtt_connect_failures = f.counter("mqtt_connect_failures", "Failed connections to the MQTT broker, by reason.", ["reason"])
        self.events = f.counter("events", "Notable daemon events by name.", ["event"])
        # SGLang's router ([router]).
        self.router_registered = f.gauge("router_registered", "1 while the server is registered with SGLang's router, else 0.")
        self.router_remove = Histogram(
            f"{PREFIX}_router_remove_seconds",
            "From the decision (a death noticed, a stop about to begin) to the router's answer to the removal.",
            buckets=ROUTER_REMOVE_BUCKETS, registry=f.registry,
        )
        self.router_call_failures = f.counter("router_call_failures", "Failed calls to SGLang's router, by operation.", ["op"])
        # A multi-node group ([group], docs/group.md).
        self.group_etcd_up = f.gauge("group_etcd_up", "1 while etcd answers the group's node, 0 during an outage (NaN = no [group]).")
        self.group_leader = f.gauge("group_leader", "1 while this node's daemon leads its group, else 0 (NaN = no [group]).")
        self.group_generation = f.gauge("group_generation", "The last generation the group's leader decided, seen from the leader (NaN = none yet).")
        # The links the daemon reconnects (supervisor.aio.Reconnect): etcd for [group] and for
        # [fleet], SGLang's router, the MQTT broker.
        self.link_up = f.gauge("link_up", "1 while the link answers, 0 during an outage (NaN = not configured, or not answered or failed yet).", ["link"])
        self.link_outages = f.counter("link_outages", "Outages of a link (each one however often it was retried).", ["link"])

    def _declare_memory_model(self, f: _Families) -> None:
        """The memory model (docs/capacity.md): the recommended fraction, KV pressure, climbs."""
        self.recommended = f.gauge("recommended_fraction", "The memory model's highest stable fraction, f* (NaN = it cannot say yet).")
        self.predicted_kv_tokens = f.gauge("predicted_kv_tokens", "KV tokens the memory model predicts at f* (NaN = it cannot say yet).")
        self.kv_pressure = f.counter("kv_pressure", "SGLang's KV-pressure signals while serving (not crashes), by source.", ["source"])
        self.climbs = f.counter("climbs", "Climbs to a higher fraction ([policy] climb), and their fall-backs.", ["outcome"])

    def _preset(self) -> None:
        """Every bounded label value at 0 (so ``increase()`` works from the first one), and
        what is not known yet as NaN."""
        for metric, label_values in (
            (self.state, [s.value for s in State]),
            (self.crashes, [c.value for c in Cause]),
            (self.restarts, [c.value for c in Cause]),
            (self.probe_failures, PROBE_FAILURE_REASONS),
            (self.alerts_sent, ALERT_KIND_LABELS),
            (self.alerts_dropped, ALERT_KIND_LABELS),
            (self.mqtt_connect_failures, MQTT_FAILURE_REASONS),
            (self.events, COUNTED_EVENTS),
            (self.router_call_failures, ROUTER_OPS),
            (self.link_outages, LINKS),
            (self.kv_pressure, KV_PRESSURE_SOURCES),
            (self.climbs, CLIMB_OUTCOMES),
        ):
            for value in label_values:
                metric.labels(value)
        for unknown in (self.fraction, self.ladder_rung, self.mqtt_connected, self.group_etcd_up, self.group_leader,
                        self.group_generation):
            unknown.set(NAN)
        for link in LINKS:
            self.link_up.labels(link).set(NAN)

    # -- EventSink ---------------------------------------------------------------------

    # -- a re-exec carries the counters across (docs/upgrade.md) ----------------------------

    def _counters(self) -> list[Counter]:
        return [v for v in vars(self).values() if isinstance(v, Counter)]

    def counter_values(self) -> list[tuple[str, dict[str, str], float]]:
        """Every counter's value by family and labels: what a re-exec hands over, so that a
        scrape after it sees the counts go on, not a reset."""
        return [(family.name, dict(sample.labels), sample.value)
                for counter in self._counters() for family in counter.collect()
                for sample in family.samples if sample.name.endswith("_total") and sample.value > 0]

    def restore_counters(self, values: Iterable[Sequence[Any]]) -> None:
        """``counter_values`` of the program this one replaced, added to the counts (a value
        for a counter or a label this version does not have is left out)."""
        by_name = {family.name: c for c in self._counters() for family in c.describe()}
        for name, labels, value in values:
            counter = by_name.get(str(name))
            if counter is None or not isinstance(value, int | float) or value <= 0 or not isinstance(labels, dict):
                continue
            try:
                (counter.labels(**labels) if labels else counter).inc(float(value))
            except ValueError:
                continue  # labels this version's counter does not take

    def emit(self, event: Event) -> None:
        """Update the metrics an event touches; other events are ignored. Never raises.

        One ``match`` on the event's class reads its typed fields: each event carries what
        its metrics need (the fraction it ran at, the state it left), so the sink keeps no
        copy of the core's state, only what it alone joins across events (see ``__init__``).
        """
        try:
            if isinstance(event, COUNTED):
                self.events.labels(event.kind).inc()
            self._dispatch(event)
        except Exception as exc:  # a sink must never raise into a restart decision
            log.warning("metrics_event_failed", daemon_event=getattr(event, "kind", "?"), error=repr(exc))

    def _dispatch(self, event: Event) -> None:
        match event:
            case ServerLaunched():
                self._launched(event)
            case StateChanged(from_=before, to=to):
                if to is State.READY and before is not State.READY:
                    self._probe_ok = True  # READY means /health just answered 200
                self._set_state(to)
            case ServerReady(startup_s=startup_s):
                self._serving(event.mem_fraction_static, event.hicache_size_gb)
                self.startup_duration.observe(startup_s)
                self.consecutive_failures.set(0)
            case Recovered():
                self._serving(event.mem_fraction_static, event.hicache_size_gb)
            case StartupFactsEvent(ranks=ranks):
                self._startup_facts(ranks)
            case Crash(cause=cause, consecutive_failures=failures):
                self.crashes.labels(cause.value).inc()
                self.last_crash.set(self._clock())
                self.consecutive_failures.set(failures)
                self._probe_ok = False
                self._refresh()
            case RestartScheduled(cause=cause, delay_s=delay_s):
                self.restarts.labels(cause.value).inc()
                self.backoff_delay.set(delay_s)
            case GaveUp():
                self.gave_up.set(1)
            case ServerHeld():
                self.held.set(1)
            case ServerReleased():
                self.held.set(0)
            case Recommended(fraction=fraction, kv_tokens_at=tokens):
                self.recommended.set(NAN if fraction is None else fraction)
                self.predicted_kv_tokens.set(NAN if fraction is None or tokens is None else tokens)
            case KvPressureSeen(source=source, signals=signals):
                self.kv_pressure.labels(source=source).inc(signals)
            case Climbed():
                self.climbs.labels(outcome="climbed").inc()
            case ClimbFellBack():
                self.climbs.labels(outcome="fell_back").inc()
            case ClimbKept():
                self.climbs.labels(outcome="kept").inc()
            case HeadroomLow(threshold_gb=threshold_gb):
                self.headroom_min.set(threshold_gb * GIB)
            case GpuMemoryStuck():
                self.gpu_memory_stuck.set(1)
            case GpuSample(gpus=gpus):
                self._gpu_sample(gpus)
            case GpuProbeFailed():
                self.gpu_probe_errors.inc()
            case ProbeAnswered():
                self._probe(event)
            case _:
                self._dispatch_links(event)

    def _dispatch_links(self, event: Event) -> None:
        """The events of the daemon's links: SGLang's router, a group's etcd, the fleet, MQTT."""
        match event:
            case RouterRegistered():
                self.router_registered.set(1)
                self._link("router", up=True)  # the router answered (a first answer is no link_up)
            case RouterRemoved(after_s=after_s):
                self.router_registered.set(0)
                if after_s is not None and math.isfinite(after_s) and after_s >= 0:
                    self.router_remove.observe(after_s)
            case RouterCallFailed(op=op):
                self.router_call_failures.labels(op if op in ROUTER_OPS else "list").inc()
            case GroupJoined():
                self.group_etcd_up.set(1)
                self.group_leader.set(0)
                self.link_up.labels("group").set(1)
            case GroupLeader():
                self.group_leader.set(1)
                self.group_etcd_up.set(1)
            case GroupGeneration(number=number):
                self.group_generation.set(number)
            # The group's link reports its outages with its own events (one is an alert):
            # the link metric reads them as the others' link_down / link_up.
            case GroupEtcdUnreachable():
                self.group_etcd_up.set(0)
                self.group_leader.set(0)  # a lost session ends a leadership
                self._link("group", up=False)
            case GroupEtcdRecovered():
                self.group_etcd_up.set(1)
                self._link("group", up=True)
            case LinkDown(link=link):
                self._link(link, up=False)
            case LinkUp(link=link):
                self._link(link, up=True)
            case FleetApplied() | FleetUpdated():
                self._link("fleet", up=True)  # etcd answered the fleet (a first answer is no link_up)
            case _:
                pass

    def alerting_health(self, kind: str, value: object) -> None:
        """The MQTT adapter's ``on_health(kind, value)`` hook, e.g. ("alert_sent", "crash").
        Not daemon events (the adapter's own reports, by name); never raises."""
        try:
            match kind:
                case "alert_sent":
                    self.alerts_sent.labels(_alert_kind(value)).inc()
                case "alert_dropped":
                    self.alerts_dropped.labels(_alert_kind(value)).inc()
                case "mqtt_connected":
                    self.mqtt_connected.set(1 if value else 0)
                case "mqtt_connect_failed":
                    reason = value if isinstance(value, str) and value in MQTT_FAILURE_REASONS else "error"
                    self.mqtt_connect_failures.labels(reason).inc()
                case "link" if isinstance(value, LinkDown | LinkUp):
                    self._dispatch(value)
        except Exception as exc:  # metrics trouble must not stop alerting
            log.warning("metrics_event_failed", daemon_event=kind, error=repr(exc))

    def _link(self, link: str, *, up: bool) -> None:
        """A link answered (``up``) or an outage of it began."""
        if link not in LINKS:
            return  # a bounded label: only the links the daemon has
        self.link_up.labels(link).set(1 if up else 0)
        if not up:
            self.link_outages.labels(link).inc()

    # -- state ---------------------------------------------------------------------------

    def _set_state(self, state: State) -> None:
        self._state = state
        for s in State:
            self.state.labels(s.value).set(1 if s is state else 0)
        if state is State.GAVE_UP:
            self.gave_up.set(1)
        elif state in (State.PREPARING, State.STARTING):
            self.gave_up.set(0)
        if state not in (State.BACKOFF, State.RESTARTING):
            self.backoff_delay.set(0)
        if state is State.READY:
            self.gpu_memory_stuck.set(0)
        self._refresh()

    def _refresh(self) -> None:
        self.server_up.set(1 if self._state is State.READY and self._probe_ok else 0)

    def _set_ladder(self, ladder: Sequence[float]) -> None:
        rungs = [x for x in (_number(v) for v in ladder) if x is not None]
        self.fraction_floor.set(min(rungs) if rungs else NAN)

    def _run_settings(self, fraction: float | None, hicache_size_gb: float | None) -> None:
        """The fraction and host cache size the current run was launched with."""
        self.fraction.set(_gauge_value(fraction))
        self.hicache.set(_gauge_value(hicache_size_gb or 0, HICACHE_GB))

    # -- what the events do ----------------------------------------------------------------

    def _launched(self, event: ServerLaunched) -> None:
        self.launches.inc()
        self._run_settings(event.mem_fraction_static, event.hicache_size_gb)
        self.ladder_rung.set(_gauge_value(event.rung))
        for rank_gauge, _ in self._rank_gauges.values():
            rank_gauge.clear()  # rank facts describe one run
        self._rank_gpus = {}
        self._rank_gpu_shown = {}
        self.rank_gpu.clear()
        self.gave_up.set(0)
        self._probe_ok = False
        self.backoff_delay.set(0)
        self.gpu_memory_stuck.set(0)
        self._refresh()

    def _serving(self, fraction: float | None, hicache_size_gb: float | None) -> None:
        self._run_settings(fraction, hicache_size_gb)
        self._probe_ok = True
        self._refresh()

    def _startup_facts(self, ranks: Mapping[str, Json]) -> None:
        for rank, facts in ranks.items():
            if not isinstance(facts, Mapping):
                continue
            for key, (rank_gauge, scale) in self._rank_gauges.items():
                value = _number(facts.get(key))
                if value is not None:
                    rank_gauge.labels(str(rank)).set(value * scale)
        self._rank_gpus = rank_gpus(str(rank) for rank in ranks)
        self._show_rank_gpus()

    def _show_rank_gpus(self) -> None:
        """Bring rank_gpu_info up to date; a series changes only when its GPU does."""
        wanted: dict[str, dict[str, str]] = {}
        order = self._gpu_indices or self._sampled
        host = self._hostname
        for rank, position in self._rank_gpus.items():
            if order and position >= len(order):
                continue  # more ranks than GPUs known: no guess
            gpu = order[position] if order else str(position)  # nothing sampled yet: GPU i
            wanted[rank] = {"gpu": gpu, "UUID": self._uuids.get(gpu, ""), "Hostname": host, "hostname": host}
        for rank in self._rank_gpu_shown.keys() - wanted.keys():
            self.rank_gpu.remove(rank)
        for rank, labels in wanted.items():
            if self._rank_gpu_shown.get(rank) != labels:
                self.rank_gpu.labels(rank).info(labels)
        self._rank_gpu_shown = wanted

    def _gpu_sample(self, gpus: Iterable[Json]) -> None:
        # Each GPU is a {index, uuid, total_bytes, free_bytes} record (supervisor.core.events);
        # a malformed one raises here and emit logs it.
        sampled = []
        for gpu in gpus:
            labels = (str(gpu["index"]), str(gpu.get("uuid") or ""))
            sampled.append(labels[0])
            if labels[1]:
                self._uuids[labels[0]] = labels[1]
            for metric, key in ((self.gpu_total, "total_bytes"), (self.gpu_free, "free_bytes")):
                value = _number(gpu.get(key))
                if value is not None:
                    metric.labels(*labels).set(value)
        if sampled:
            self._sampled = tuple(sampled)
        self._show_rank_gpus()

    def _probe(self, event: ProbeAnswered) -> None:
        if self._state is State.STARTING:
            return  # startup polls: refused by design until ready; startup_duration covers it
        self.probe_duration.observe(event.duration_s)
        self._probe_ok = event.ok
        if not event.ok:
            self.probe_failures.labels("no_response" if event.status is None else "http_status").inc()
        self._refresh()


def _alert_kind(value: object) -> str:
    return value if isinstance(value, str) and value in ALERT_KIND_LABELS else "other"
