"""On-call alerts: an ``EventSink`` that words the daemon's events as MQTT messages.

``AlertSink.emit`` is synchronous and O(1): one ``match`` on the event's class turns an
alerting event into its JSON payload (a sentence a person woken at 3 a.m. can act on, and
the figures it rests on), and a state change into the retained state snapshot. It hands
the finished message (topic, payload, QoS, retain) to its ``Outbox``; the MQTT transport
(``supervisor.adapters.mqtt.MqttTransport``: the bounded outbox, the broker connection,
reconnects, TLS, the password file, the Last Will and ``online``/``offline``) delivers it.
The composition root (``supervisor.cli.run.build_alerter``) wires the two.

Topics (``{prefix}/{host}/{instance}/...``):

- ``status``: retained ``online`` / ``offline`` (the transport's: the Will, and a clean stop);
- ``state``: retained JSON snapshot, sent on every ``StateChanged`` (only the latest);
- ``event/{kind}``: JSON per alert (``crash``, ``restart``, ``recovered``, ``gave_up``,
  ``headroom_low``, ``gpu_memory_stuck``, ``daily_summary``, ``drill``...: an event class's
  ``alert``).

The payload builders are pure functions (time and ids are passed in). Each alert's ``id``
(a uuid4) lets consumers drop the duplicates an at-least-once delivery may bring.
"""

from __future__ import annotations

import contextlib
import enum
import json
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol, TypedDict

import structlog
from structlog.typing import FilteringBoundLogger

from supervisor.core.config import MqttConfig
from supervisor.core.events import (
    EVENTS,
    Climbed,
    ClimbFellBack,
    Crash,
    DaemonFailed,
    DailySummary,
    Event,
    GaveUp,
    GpuMemoryStuck,
    GroupEtcdUnreachable,
    HeadroomLow,
    PortInUse,
    Recovered,
    ReexecRefused,
    RestartScheduled,
    ServerDown,
    ServerHeld,
    ServerReleased,
    StateChanged,
)
from supervisor.core.model import Cause, rfc3339

SCHEMA_VERSION = 1
DRILL = "drill"
TRUNCATION_MARKER = "\n... [truncated {n} chars]"
MESSAGE_MAX_CHARS = 500  # one sentence for a phone; a gave_up reason or GPU list can be long
UNRECOGNISED_CHARS = 120  # the line it could not name, in a crash alert's sentence


@dataclass(frozen=True, slots=True, kw_only=True)
class Drill(Event):
    """The drill's alert (``sglang-supervisor drill``): the alert path end to end. It is no
    daemon event (no ``kind``), only an alert."""

    alert = DRILL
    severity = "info"


# alert kind -> severity: each alerting event class says its own (supervisor/core/events/)
_ALERTING: tuple[type[Event], ...] = (*EVENTS.values(), Drill)
SEVERITY: dict[str, str] = {cls.alert: cls.severity for cls in _ALERTING if cls.alert}


class Outbox(Protocol):
    """Where the sink's finished messages go (``supervisor.adapters.mqtt.MqttTransport``).
    Neither call may block or raise."""

    def send(self, topic: str, payload: bytes, *, qos: int, retain: bool, kind: str, alert_id: str) -> None:
        """An alert of ``kind``: delivered in order, at least once."""

    def latest(self, topic: str, payload: bytes, *, qos: int, retain: bool) -> None:
        """A snapshot: it replaces the one not yet delivered (only the newest matters)."""


def utcnow() -> datetime:
    """Wall-clock time for alert timestamps (the only clock this module reads)."""
    return datetime.now(UTC)


def default_host() -> str:
    """This machine's short host name, as it appears in topics and messages."""
    return socket.gethostname().split(".")[0] or "localhost"


# --------------------------------------------------------------------------- topics


def topic_segment(text: str) -> str:
    """``text`` made safe as one topic level (no ``/``, wildcards, or NUL)."""
    cleaned = "".join("_" if c in "/+#\0" or c.isspace() else c for c in str(text))
    return cleaned or "_"


@dataclass(frozen=True, slots=True)
class Topics:
    """The topics of one supervised instance."""

    status: str
    state: str
    event_prefix: str

    @classmethod
    def of(cls, prefix: str, host: str, instance: str) -> Topics:
        base = f"{prefix.rstrip('/')}/{topic_segment(host)}/{topic_segment(instance)}"
        return cls(status=f"{base}/status", state=f"{base}/state", event_prefix=f"{base}/event")

    def event(self, kind: str) -> str:
        return f"{self.event_prefix}/{kind}"


def client_id(cfg: MqttConfig, host: str, instance: str) -> str:
    """The MQTT client id: ``[mqtt] client_id``, else ``sglang-supervisor-HOST-INSTANCE``."""
    return cfg.client_id or f"sglang-supervisor-{topic_segment(host)}-{topic_segment(instance)}"


# --------------------------------------------------------------------------- the words


def truncate_evidence(evidence: object, max_chars: int) -> str:
    """Evidence lines joined by newlines, cut to ``max_chars`` with a marker saying so."""
    if evidence is None:
        return ""
    text = "\n".join(str(line) for line in evidence) if isinstance(evidence, list | tuple) else str(evidence)
    if len(text) <= max_chars:
        return text
    # The marker's own length depends on n; reserve room for the largest possible n.
    reserve = len(TRUNCATION_MARKER.format(n=len(text)))
    keep = max(max_chars - reserve, 0)
    return text[:keep] + TRUNCATION_MARKER.format(n=len(text) - keep)


def _plain(value: object) -> object:
    """An enum as its value (the edge form, ``Event.fields``); anything else as it is."""
    return value.value if isinstance(value, enum.Enum) else value


def _fraction(value: object) -> str:
    return "SGLang's default fraction" if value is None else f"{value:g}" if isinstance(value, float | int) else str(value)


def _seconds(value: object) -> str:
    return f"{round(float(value), 1):g} s" if isinstance(value, float | int) else "a moment"


def _cause_words(cause: object) -> str:
    if isinstance(cause, str):
        with contextlib.suppress(ValueError):
            return Cause.parse(cause).summary
    return f"an error ({cause})" if cause else "an unknown error"


def _died_of(cause: object, phase: object) -> str:
    words = _cause_words(cause)
    if phase and " while " not in words and " during " not in words:
        words += f" while {_plain(phase)}"
    return words


def _gb(value: object) -> str:
    return f"{value:.1f} GB" if isinstance(value, float | int) else "? GB"


def _cut(text: object, limit: int) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class Said:
    """What an alert says: its sentence, and the figures its payload carries, as the event
    gives them (``before``/``after``: the fraction before and after)."""

    message: str
    cause: object = None
    evidence: object = None
    before: object = None
    after: object = None
    attempt: object = None
    next_retry_s: object = None
    unrecognised: object = None


def _crash(e: Crash, who: str) -> Said:
    at = _fraction(e.mem_fraction_static)
    line = e.unrecognised
    if e.killed:
        sentence = f"{who} was killed by {e.killed} at {at} after it was ready; nothing was logged since; "
    elif e.cause == Cause.OTHER and line:
        sentence = f"{who} crashed at {at} with an error it does not recognise: {_cut(line, UNRECOGNISED_CHARS)}; "
    elif e.certain is False:
        phase = f" while {_plain(e.phase)}" if e.phase else ""
        seen = f": {_cut(line, UNRECOGNISED_CHARS)}" if line else ""
        sentence = f"{who} crashed at {at}; unsure of the cause (read as {_plain(e.cause)}{phase}, uncertain){seen}; "
    else:
        sentence = f"{who} died of {_died_of(e.cause, e.phase)} at {at}; "
    if e.next_retry_s is None:
        sentence += "not restarting; needs a human"
    else:
        # an uncertain reading never stops the night: it restarts, and the crash loop ends it
        sentence += "restarting with backoff at " if e.certain is False else "restarting at "
        sentence += _fraction(e.next_mem_fraction_static)
        if e.next_hicache_size_gb not in (None, e.hicache_size_gb):
            sentence += f" with --hicache-size {e.next_hicache_size_gb}"
        sentence += f" in {_seconds(e.next_retry_s)}"
        if e.certain is False:
            sentence += "; it gives up if it repeats"
    return Said(sentence, cause=e.cause, evidence=e.evidence, before=e.mem_fraction_static,
                after=e.next_mem_fraction_static, attempt=e.attempt, next_retry_s=e.next_retry_s,
                unrecognised=e.unrecognised)


def _restart(e: RestartScheduled, who: str) -> Said:
    return Said(f"{who} restarting at {_fraction(e.mem_fraction_static)} in {_seconds(e.delay_s)} "
                f"(attempt {e.attempt}) after {_died_of(e.cause, None)}",
                cause=e.cause, before=e.mem_fraction_before, after=e.mem_fraction_static, attempt=e.attempt,
                next_retry_s=e.delay_s)


def _recovered(e: Recovered, who: str) -> Said:
    return Said(f"{who} is serving again at {_fraction(e.mem_fraction_static)} after "
                f"{_died_of(e.cause, None)} (attempt {e.attempt}, startup took {_seconds(e.startup_s)})",
                cause=e.cause, before=e.mem_fraction_before, after=e.mem_fraction_static, attempt=e.attempt)


def _gave_up(e: GaveUp, who: str) -> Said:
    crashes = e.crashes
    after = f" after {crashes} crash{'es' if crashes != 1 else ''}" if crashes else ""
    return Said(f"{who} gave up{after}: {e.reason or _cause_words(e.cause)}; needs a human",
                cause=e.cause, before=e.mem_fraction_static)


def _headroom_low(e: HeadroomLow, who: str) -> Said:
    sentence = (f"{who} has only {_gb(e.avail_mem_gb)} of GPU headroom on {e.rank or 'a rank'} "
                f"at {_fraction(e.mem_fraction_static)} (wants {_gb(e.threshold_gb)}); ")
    if e.action == "step_down":
        sentence += f"restarting at {_fraction(e.next_mem_fraction_static)} before it OOMs"
    else:
        sentence += "lower --mem-fraction-static before the next burst OOMs it"
    return Said(sentence, before=e.mem_fraction_static, after=e.next_mem_fraction_static)


def _gpu_memory_stuck(e: GpuMemoryStuck, who: str, host: str) -> Said:
    gpus = ", ".join(
        f"GPU {g.get('index')}: {_gb((g.get('free_bytes') or 0) / 1e9)} of {_gb((g.get('total_bytes') or 0) / 1e9)} free"
        for g in (e.gpus or []) if isinstance(g, Mapping)
    )
    return Said(f"GPU memory on {host} was still in use {_seconds(e.timeout_s)} after {who.rsplit(' on ', 1)[0]} "
                f"stopped ({gpus or 'no details'}); kill what holds it or reset the GPU",
                evidence=[json.dumps(g, default=str) for g in e.gpus or []], before=e.mem_fraction_static)


def _down(e: ServerDown, who: str) -> Said:
    part = e.title if e.title not in (None, "main") else "its main process"
    return Said(f"{who} is down: {part} (pid {e.pid}) died while {_plain(e.phase) or 'running'}; "
                "reading its log, the cause and the restart follow")


def _port_in_use(e: PortInUse, who: str) -> Said:
    holders = ", ".join(f"pid {h.get('pid')} {h.get('name') or '?'}" for h in (e.holders or [])
                        if isinstance(h, Mapping))
    return Said(f"{who} cannot start: port {e.port} is held by a process it did not start "
                f"({holders or 'unknown'}); it is left alone, retrying - stop it or change the port")


def _daemon_failed(e: DaemonFailed, who: str) -> Said:
    if e.reexec:
        return Said(f"the supervisor of {who} hit a bug ({e.task}: {e.error}); it re-executes in place, "
                    "its servers serving on - report the bug with the journal's traceback")
    return Said(f"the supervisor of {who} failed ({e.task}: {e.error}); it stopped "
                "its server and exits for systemd to restart it")


def _reexec_refused(e: ReexecRefused, who: str) -> Said:
    return Said(f"the supervisor of {who} did not re-execute ({e.error}); the running one supervises on, "
                "its servers untouched - fix the installed code and ask again")


def _etcd_unreachable(e: GroupEtcdUnreachable, who: str) -> Said:
    return Said(f"{who} cannot reach etcd ({e.error}); its server keeps running, but no group "
                "generation starts and nothing is relaunched until etcd answers - check the etcd cluster")


def _daily_summary(e: DailySummary, who: str) -> Said:
    crashes = e.crashes or 0
    causes = f" ({', '.join(e.causes or [])})" if crashes else ""
    before, after = e.mem_fraction_static, e.next_mem_fraction_static
    fraction = (f"mem_fraction_static {_fraction(after)}" if before == after
                else f"mem_fraction_static {_fraction(before)} -> {_fraction(after)}")
    lost = float(e.lost_s or 0.0)
    sentence = (f"{who}, the last {e.period_h:g} h: serving {float(e.serving_pct or 0):.1f} % of the time; "
                f"{crashes} crash{'es' if crashes != 1 else ''}{causes}, "
                f"{lost / 60:.1f} min lost; {fraction}; now {e.state}")
    if e.least_free_gb is not None:
        sentence += f"; least free GPU memory {_gb(e.least_free_gb)}"
    problems = e.open_problems or ()
    sentence += f"; open: {', '.join(problems)} - see the report" if problems else "; nothing to do"
    return Said(sentence, before=before, after=after)


def _climb(e: Climbed, who: str) -> Said:
    gain = e.kv_tokens_gain
    tokens = f": {gain * 100:+.0f} % KV tokens" if isinstance(gain, int | float) else ""
    return Said(f"{who} raised to {_fraction(e.mem_fraction_static)} from {_fraction(e.mem_fraction_before)}"
                f"{tokens}; drained and relaunched, on probation")


def _climb_fell_back(e: ClimbFellBack, who: str) -> Said:
    return Said(f"{who} fell back to {_fraction(e.mem_fraction_static)}: {_fraction(e.mem_fraction_failed)} "
                f"failed on probation ({_died_of(e.cause, None)}); it stays the ceiling, no climb past it",
                cause=e.cause)


def _held(e: ServerHeld, who: str) -> Said:
    when = "is still stopped (the daemon restarted)" if e.at_boot else "was stopped"
    return Said(f"{who} {when} by an operator for maintenance since {e.since}: {e.reason}; "
                "no crash, nothing to do until 'sglang-supervisor start'")


def _released(e: ServerReleased, who: str) -> Said:
    return Said(f"{who} is being started again by an operator (held since {e.held_since}): {e.reason}")


def said(event: object, *, host: str, instance: str) -> Said | None:
    """What the alert of ``event`` says, by its class (one wording per alert kind); None when
    it is no alert."""
    who = f"sglang {instance} on {host}"
    match event:
        case Crash():
            return _crash(event, who)
        case RestartScheduled():
            return _restart(event, who)
        case Recovered():
            return _recovered(event, who)
        case GaveUp():
            return _gave_up(event, who)
        case HeadroomLow():
            return _headroom_low(event, who)
        case GpuMemoryStuck():
            return _gpu_memory_stuck(event, who, host)
        case ServerDown():
            return _down(event, who)
        case PortInUse():
            return _port_in_use(event, who)
        case DaemonFailed():
            return _daemon_failed(event, who)
        case ReexecRefused():
            return _reexec_refused(event, who)
        case GroupEtcdUnreachable():
            return _etcd_unreachable(event, who)
        case DailySummary():
            return _daily_summary(event, who)
        case Climbed():
            return _climb(event, who)
        case ClimbFellBack():
            return _climb_fell_back(event, who)
        case ServerHeld():
            return _held(event, who)
        case ServerReleased():
            return _released(event, who)
        case Drill():
            return Said(f"Drill from {who}: the alert path works; no action needed")
        case _:
            return None


def describe(event: Event, *, host: str, instance: str) -> str:
    """One sentence a person woken at 3 a.m. can act on, from the event's own fields."""
    words = said(event, host=host, instance=instance)
    return words.message if words is not None else f"sglang {instance} on {host}: {event.alert or event.kind}"


# --------------------------------------------------------------------------- the payloads


class AlertPayload(TypedDict):
    """The JSON of one alert (docs/alerts.md); the values taken from event fields are as given."""

    schema: int
    ts: str
    host: str
    instance: str
    id: str
    kind: str
    severity: str
    cause: object
    evidence: str
    mem_fraction_static: object
    next_mem_fraction_static: object
    attempt: object
    next_retry_s: object
    message: str
    unrecognised: str | None


# The retained state snapshot; functional syntax because "from" is a keyword.
StatePayload = TypedDict("StatePayload", {
    "schema": int,
    "ts": str,
    "host": str,
    "instance": str,
    "state": object,
    "from": object,
    "reason": object,
    "mem_fraction_static": object,
    "restarts": object,
    "last_cause": object,
})


def build_alert(
    event: Event,
    *,
    host: str,
    instance: str,
    ts: datetime,
    alert_id: str,
    evidence_max_chars: int,
) -> AlertPayload | None:
    """The JSON payload for an alerting event, or None when ``event`` is no alert."""
    words = said(event, host=host, instance=instance)
    if words is None or not event.alert:
        return None
    return {
        "schema": SCHEMA_VERSION,
        "ts": rfc3339(ts),
        "host": host,
        "instance": instance,
        "id": alert_id,
        "kind": event.alert,
        "severity": event.severity,
        "cause": _plain(words.cause),
        "evidence": truncate_evidence(words.evidence, evidence_max_chars),
        "mem_fraction_static": words.before,
        "next_mem_fraction_static": words.after,
        "attempt": words.attempt,
        "next_retry_s": words.next_retry_s,
        "message": truncate_evidence(words.message, MESSAGE_MAX_CHARS),
        # a crash's line it could not name (normalised), for a person to teach it ([[diagnosis.rule]])
        "unrecognised": truncate_evidence(words.unrecognised, evidence_max_chars) if words.unrecognised else None,
    }


def build_state(event: StateChanged, *, host: str, instance: str, ts: datetime) -> StatePayload:
    """The retained state snapshot sent on ``StateChanged``."""
    return {
        "schema": SCHEMA_VERSION,
        "ts": rfc3339(ts),
        "host": host,
        "instance": instance,
        "state": _plain(event.to),
        "from": _plain(event.from_),
        "reason": event.reason,
        "mem_fraction_static": event.mem_fraction_static,
        "restarts": event.restarts,
        "last_cause": _plain(event.last_cause),
    }


def dumps(payload: Mapping[str, object]) -> bytes:
    """A payload as the bytes that go on the wire (compact UTF-8 JSON)."""
    return json.dumps(payload, default=str, ensure_ascii=False, separators=(",", ":")).encode()


def drill_message(cfg: MqttConfig, *, host: str, instance: str, ts: datetime, alert_id: str) -> tuple[str, bytes]:
    """The drill alert's topic and payload, made as a real alert's are."""
    payload = build_alert(Drill(), host=host, instance=instance, ts=ts, alert_id=alert_id,
                          evidence_max_chars=cfg.evidence_max_chars)
    assert payload is not None
    return Topics.of(cfg.topic_prefix, host, instance).event(DRILL), dumps(payload)


# --------------------------------------------------------------------------- the sink


class AlertSink:
    """An EventSink that words on-call alerts and hands them, finished, to an ``Outbox``."""

    def __init__(
        self,
        cfg: MqttConfig,
        *,
        host: str,
        instance: str,
        outbox: Outbox,
        logger: FilteringBoundLogger | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._cfg = cfg
        self._host = host
        self._instance = instance
        self._outbox = outbox
        self.topics = Topics.of(cfg.topic_prefix, host, instance)
        self._log = logger if logger is not None else structlog.get_logger("supervisor.sinks.alerts")
        self._clock = clock

    def emit(self, event: Event) -> None:
        """Hand the alert for ``event`` (if it is one) to the outbox; never blocks, never raises."""
        try:
            self._emit(event)
        except Exception as exc:  # a sink must not raise into a restart decision
            with contextlib.suppress(Exception):
                self._log.error("alert_emit_failed", alert_event=getattr(event, "kind", "?"), error=repr(exc))

    def _emit(self, event: Event) -> None:
        now = self._clock()
        cfg = self._cfg
        match event:
            case StateChanged():
                state = build_state(event, host=self._host, instance=self._instance, ts=now)
                self._outbox.latest(self.topics.state, dumps(state), qos=cfg.qos, retain=True)
            case _:
                alert_id = str(uuid.uuid4())
                payload = build_alert(event, host=self._host, instance=self._instance, ts=now, alert_id=alert_id,
                                      evidence_max_chars=cfg.evidence_max_chars)
                if payload is not None:
                    kind = payload["kind"]
                    self._outbox.send(self.topics.event(kind), dumps(payload), qos=cfg.qos, retain=False, kind=kind,
                                      alert_id=alert_id)
