"""On-call alerts over MQTT: an ``EventSink`` that never slows the supervisor down.

``MqttAlerter.emit`` is synchronous and O(1): it turns a daemon event into a JSON payload
and appends it to a bounded outbox (the oldest is dropped, counted and logged when it is
full). A task of its own owns the broker connection (aiomqtt has no reconnect of its own):
connect with a Last Will of ``offline``, publish a retained ``online``, drain the outbox,
and on any failure reconnect with exponential backoff and jitter. A message leaves the
outbox only once the broker acknowledged it, so delivery is at least once; the payload's
``id`` lets consumers drop duplicates.

Topics (``{prefix}/{host}/{instance}/...``):

- ``status``: retained ``online`` / ``offline`` (the Will, and a clean stop);
- ``state``: retained JSON snapshot, sent on every ``state_changed`` (only the latest);
- ``event/{kind}``: JSON per alert (``crash``, ``restart``, ``recovered``, ``gave_up``,
  ``headroom_low``, ``gpu_memory_stuck``, ``daily_summary``, ``drill``).

The payload builders are pure functions (time and ids are passed in); the reconnects are
``supervisor.aio.Reconnect``'s, the same as every link's: the restart policy's backoff, and
one line per outage (each further failed try is a debug line, and counted).
The password is read from ``password_file`` at each connect and handed to the client only:
it is never stored on the alerter, logged, or put in a repr or an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import ssl
import stat
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import aiomqtt
import structlog
from aiomqtt.exceptions import MqttConnectError
from structlog.typing import FilteringBoundLogger

from supervisor.aio import Backoff, Reconnect, cancel_and_wait, within
from supervisor.core.config import MqttConfig
from supervisor.core.events import ALERT_KINDS, EVENTS, Event, LinkDown, LinkUp
from supervisor.core.model import Cause, rfc3339

T = TypeVar("T")

SCHEMA_VERSION = 1
DRILL = "drill"
# alert kind -> severity: each alerting event class says its own (supervisor/core/events.py)
SEVERITY: dict[str, str] = {
    **{cls.alert: cls.severity for cls in EVENTS.values() if cls.alert},
    DRILL: "info",
}
TRUNCATION_MARKER = "\n... [truncated {n} chars]"

# paho's own (debug) log lines go here; they carry flags, never the password.
_PAHO_LOG = logging.getLogger("supervisor.sinks.alerts.mqtt")

HealthCallback = Callable[[str, object], None]
"""``on_health(kind, value)``: ("alert_sent", alert kind), ("alert_dropped", alert kind),
("mqtt_connected", bool), ("mqtt_connect_failed", short reason), ("link", a ``LinkDown`` or
``LinkUp`` of link ``mqtt``: once per outage)."""


class AlertsError(Exception):
    """The alerts adapter's own error (unreadable password file, lost connection, misuse)."""


def utcnow() -> datetime:
    """Wall-clock time for alert timestamps (the only clock this module reads)."""
    return datetime.now(UTC)


def default_host() -> str:
    """This machine's short host name, as it appears in topics and messages."""
    return socket.gethostname().split(".")[0] or "localhost"


# --------------------------------------------------------------------------- pure part


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


# Reconnects (supervisor.aio.Reconnect) wait backoff.exponential_backoff: doubling from [mqtt] reconnect_initial_s up to
# reconnect_max_s, each wait jittered to [d/2, d] so that many daemons do not reconnect in step.
RECONNECT_FACTOR = 2.0
RECONNECT_JITTER = (0.5, 1.0)


MESSAGE_MAX_CHARS = 500  # one sentence for a phone; a gave_up reason or GPU list can be long


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
        words += f" while {phase}"
    return words


def _gb(value: object) -> str:
    return f"{value:.1f} GB" if isinstance(value, float | int) else "? GB"


Wording = Callable[[Callable[..., Any], str, str], str]
"""(the event's field getter, who ("sglang NAME on HOST"), host) -> the sentence."""


UNRECOGNISED_CHARS = 120  # the line it could not name, in a crash alert's sentence


def _cut(text: object, limit: int) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _crash(f: Callable[..., Any], who: str, host: str) -> str:
    at = _fraction(f("mem_fraction_static"))
    line = f("unrecognised")
    if f("killed"):
        sentence = f"{who} was killed by {f('killed')} at {at} after it was ready; nothing was logged since; "
    elif f("cause") == "other" and line:
        sentence = f"{who} crashed at {at} with an error it does not recognise: {_cut(line, UNRECOGNISED_CHARS)}; "
    elif f("certain") is False:
        phase = f" while {f('phase')}" if f("phase") else ""
        seen = f": {_cut(line, UNRECOGNISED_CHARS)}" if line else ""
        sentence = f"{who} crashed at {at}; unsure of the cause (read as {f('cause')}{phase}, uncertain){seen}; "
    else:
        sentence = f"{who} died of {_died_of(f('cause'), f('phase'))} at {at}; "
    if f("next_retry_s") is None:
        return sentence + "not restarting; needs a human"
    sentence += f"restarting at {_fraction(f('next_mem_fraction_static', f('mem_fraction_static')))}"
    if f("next_hicache_size_gb") not in (None, f("hicache_size_gb")):
        sentence += f" with --hicache-size {f('next_hicache_size_gb')}"
    return sentence + f" in {_seconds(f('next_retry_s'))}"


def _restart(f: Callable[..., Any], who: str, host: str) -> str:
    return (f"{who} restarting at {_fraction(f('mem_fraction_static'))} in {_seconds(f('delay_s'))} "
            f"(attempt {f('attempt')}) after {_died_of(f('cause'), None)}")


def _recovered(f: Callable[..., Any], who: str, host: str) -> str:
    return (f"{who} is serving again at {_fraction(f('mem_fraction_static'))} after "
            f"{_died_of(f('cause'), None)} (attempt {f('attempt')}, startup took {_seconds(f('startup_s'))})")


def _gave_up(f: Callable[..., Any], who: str, host: str) -> str:
    crashes = f("crashes") or f("consecutive_failures")
    after = f" after {crashes} crash{'es' if crashes != 1 else ''}" if crashes else ""
    return f"{who} gave up{after}: {f('reason') or _cause_words(f('cause'))}; needs a human"


def _headroom_low(f: Callable[..., Any], who: str, host: str) -> str:
    sentence = (f"{who} has only {_gb(f('avail_mem_gb'))} of GPU headroom on {f('rank') or 'a rank'} "
                f"at {_fraction(f('mem_fraction_static'))} (wants {_gb(f('threshold_gb'))}); ")
    if f("action") == "step_down":
        return sentence + f"restarting at {_fraction(f('next_mem_fraction_static'))} before it OOMs"
    return sentence + "lower --mem-fraction-static before the next burst OOMs it"


def _gpu_memory_stuck(f: Callable[..., Any], who: str, host: str) -> str:
    gpus = ", ".join(
        f"GPU {g.get('index')}: {_gb((g.get('free_bytes') or 0) / 1e9)} of {_gb((g.get('total_bytes') or 0) / 1e9)} free"
        for g in (f("gpus") or []) if isinstance(g, Mapping)
    )
    return (f"GPU memory on {host} was still in use {_seconds(f('timeout_s'))} after {who.rsplit(' on ', 1)[0]} "
            f"stopped ({gpus or 'no details'}); kill what holds it or reset the GPU")


def _down(f: Callable[..., Any], who: str, host: str) -> str:
    part = f("title") if f("title") not in (None, "main") else "its main process"
    return (f"{who} is down: {part} (pid {f('pid')}) died while {f('phase') or 'running'}; "
            "reading its log, the cause and the restart follow")


def _port_in_use(f: Callable[..., Any], who: str, host: str) -> str:
    holders = ", ".join(f"pid {h.get('pid')} {h.get('name') or '?'}" for h in (f("holders") or [])
                        if isinstance(h, Mapping))
    return (f"{who} cannot start: port {f('port')} is held by a process it did not start "
            f"({holders or 'unknown'}); it is left alone, retrying - stop it or change the port")


def _daemon_failed(f: Callable[..., Any], who: str, host: str) -> str:
    return (f"the supervisor of {who} failed ({f('task')}: {f('error')}); it stopped "
            "its server and exits for systemd to restart it")


def _etcd_unreachable(f: Callable[..., Any], who: str, host: str) -> str:
    return (f"{who} cannot reach etcd ({f('error')}); its server keeps running, but no group "
            "generation starts and nothing is relaunched until etcd answers - check the etcd cluster")


def _daily_summary(f: Callable[..., Any], who: str, host: str) -> str:
    crashes = f("crashes") or 0
    causes = f" ({', '.join(f('causes') or [])})" if crashes else ""
    before, after = f("mem_fraction_static"), f("next_mem_fraction_static")
    fraction = (f"mem_fraction_static {_fraction(after)}" if before == after
                else f"mem_fraction_static {_fraction(before)} -> {_fraction(after)}")
    lost = float(f("lost_s") or 0.0)
    sentence = (f"{who}, the last {f('period_h'):g} h: serving {float(f('serving_pct') or 0):.1f} % of the time; "
                f"{crashes} crash{'es' if crashes != 1 else ''}{causes}, "
                f"{lost / 60:.1f} min lost; {fraction}; now {f('state')}")
    if f("least_free_gb") is not None:
        sentence += f"; least free GPU memory {_gb(f('least_free_gb'))}"
    problems = f("open_problems") or []
    return sentence + (f"; open: {', '.join(problems)} - see the report" if problems else "; nothing to do")


def _climb(f: Callable[..., Any], who: str, host: str) -> str:
    gain = f("kv_tokens_gain")
    tokens = f": {gain * 100:+.0f} % KV tokens" if isinstance(gain, int | float) else ""
    return (f"{who} raised to {_fraction(f('mem_fraction_static'))} from {_fraction(f('mem_fraction_before'))}"
            f"{tokens}; drained and relaunched, on probation")


def _climb_fell_back(f: Callable[..., Any], who: str, host: str) -> str:
    return (f"{who} fell back to {_fraction(f('mem_fraction_static'))}: {_fraction(f('mem_fraction_failed'))} "
            f"failed on probation ({_died_of(f('cause'), None)}); it stays the ceiling, no climb past it")


def _drill(f: Callable[..., Any], who: str, host: str) -> str:
    return f"Drill from {who}: the alert path works; no action needed"


WORDING: dict[str, Wording] = {
    # MQTT alert kind (an event class's ``alert``) -> its one sentence
    "crash": _crash,
    "restart": _restart,
    "recovered": _recovered,
    "gave_up": _gave_up,
    "headroom_low": _headroom_low,
    "gpu_memory_stuck": _gpu_memory_stuck,
    "down": _down,
    "port_in_use": _port_in_use,
    "daemon_failed": _daemon_failed,
    "etcd_unreachable": _etcd_unreachable,
    "daily_summary": _daily_summary,
    "climb": _climb,
    "climb_fell_back": _climb_fell_back,
    DRILL: _drill,
}


def describe(kind: str, fields: Mapping[str, Any], *, host: str, instance: str) -> str:
    """One sentence a person woken at 3 a.m. can act on, from the event's own fields."""
    who = f"sglang {instance} on {host}"
    wording = WORDING.get(kind)
    return wording(fields.get, who, host) if wording else f"{who}: {kind}"


def _before_after(kind: str, fields: Mapping[str, Any]) -> tuple[object, object]:
    """The fraction before and after, as the event carries them."""
    f = fields.get
    if kind in ("crash", "headroom_low", "daily_summary"):
        return f("mem_fraction_static"), f("next_mem_fraction_static")
    if kind in ("restart", "recovered"):
        return f("mem_fraction_before"), f("mem_fraction_static")
    if kind in ("gave_up", "gpu_memory_stuck"):
        return f("mem_fraction_static"), None
    return None, None


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
    event: str,
    fields: Mapping[str, Any],
    *,
    host: str,
    instance: str,
    ts: datetime,
    alert_id: str,
    evidence_max_chars: int,
) -> AlertPayload | None:
    """The JSON payload for an alert event, or None when ``event`` is not an alert."""
    kind = DRILL if event == DRILL else ALERT_KINDS.get(event)
    if kind is None:
        return None
    before, after = _before_after(kind, fields)
    evidence = fields.get("evidence")
    unrecognised = fields.get("unrecognised")
    if evidence is None and kind == "gpu_memory_stuck":
        evidence = [json.dumps(g, default=str) for g in fields.get("gpus") or []]
    return {
        "schema": SCHEMA_VERSION,
        "ts": rfc3339(ts),
        "host": host,
        "instance": instance,
        "id": alert_id,
        "kind": kind,
        "severity": SEVERITY[kind],
        "cause": fields.get("cause"),
        "evidence": truncate_evidence(evidence, evidence_max_chars),
        "mem_fraction_static": before,
        "next_mem_fraction_static": after,
        "attempt": fields.get("attempt"),
        "next_retry_s": fields.get("delay_s") if kind == "restart" else fields.get("next_retry_s"),
        "message": truncate_evidence(
            describe(kind, fields, host=host, instance=instance), MESSAGE_MAX_CHARS
        ),
        # a crash's line it could not name (normalised), for a person to teach it ([[diagnosis.rule]])
        "unrecognised": truncate_evidence(unrecognised, evidence_max_chars) if unrecognised else None,
    }


def build_state(fields: Mapping[str, Any], *, host: str, instance: str, ts: datetime) -> StatePayload:
    """The retained state snapshot sent on ``state_changed``."""
    f = fields.get
    return {
        "schema": SCHEMA_VERSION,
        "ts": rfc3339(ts),
        "host": host,
        "instance": instance,
        "state": f("to"),
        "from": f("from"),
        "reason": f("reason"),
        "mem_fraction_static": f("mem_fraction_static"),
        "restarts": f("restarts"),
        "last_cause": f("last_cause"),
    }


def _dumps(payload: Mapping[str, object]) -> bytes:
    return json.dumps(payload, default=str, ensure_ascii=False, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- client plumbing


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message waiting for the broker."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    kind: str  # alert kind, or "state"
    id: str | None = None


def _read_password_file(path: str) -> tuple[str, int]:
    """(password, file mode); blocking, so called through ``asyncio.to_thread``."""
    with Path(path).open(encoding="utf-8") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        return fh.read().rstrip("\r\n"), mode


async def _password(cfg: MqttConfig, log: FilteringBoundLogger, warned: set[str]) -> str | None:
    """The broker password from ``password_file`` (None when there is none)."""
    if not cfg.password_file:
        return None
    try:
        password, mode = await asyncio.to_thread(_read_password_file, cfg.password_file)
    except OSError as exc:
        raise AlertsError(f"cannot read [mqtt] password_file {cfg.password_file}: {exc.strerror or type(exc).__name__}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH) and "perm" not in warned:
        warned.add("perm")
        log.warning("mqtt_password_file_readable_by_others", path=cfg.password_file, mode=oct(stat.S_IMODE(mode)),
                    hint="chmod 600 it")
    return password


def _make_client(cfg: MqttConfig, *, identifier: str, password: str | None, will: aiomqtt.Will | None,
                 timeout: float) -> aiomqtt.Client:
    tls = aiomqtt.TLSParameters(
        ca_certs=cfg.tls_ca_file or None,
        certfile=cfg.tls_cert_file or None,
        keyfile=cfg.tls_key_file or None,
        cert_reqs=ssl.CERT_REQUIRED,
    ) if cfg.tls else None
    client = aiomqtt.Client(
        cfg.host,
        cfg.port,
        username=cfg.username or None,
        password=password if cfg.username else None,
        identifier=identifier,
        will=will,
        keepalive=cfg.keepalive_s,
        timeout=timeout,
        tls_params=tls,
        tls_insecure=True if cfg.tls and cfg.tls_insecure else None,
        logger=_PAHO_LOG,
        clean_session=True,
    )
    # aiomqtt bounds the wait for CONNACK with `timeout`; paho's TCP connect and TLS
    # handshake (run in an executor thread) have their own limit, 5 s unless set.
    client._client.connect_timeout = timeout  # noqa: SLF001 -- no public setter in aiomqtt
    return client


async def _open(client: aiomqtt.Client) -> None:
    """Connect ``client``; on any failure close the socket aiomqtt would leave open."""
    try:
        await client.__aenter__()
    except BaseException:
        # After a CONNACK timeout aiomqtt keeps the socket and its reader registered;
        # paho's disconnect() closes it once the DISCONNECT is written.
        with contextlib.suppress(Exception):
            client._client.disconnect()  # noqa: SLF001 -- aiomqtt offers no abort
        raise


async def _close(client: aiomqtt.Client) -> None:
    """Disconnect cleanly if still connected (no Will is sent); errors don't matter here."""
    with contextlib.suppress(aiomqtt.MqttError, OSError):
        await client.__aexit__(None, None, None)


def _is_auth_failure(exc: BaseException) -> bool:
    rc = getattr(exc, "rc", None)
    code = getattr(rc, "value", rc)
    return isinstance(exc, MqttConnectError) and code in (4, 5, 134, 135)


def _failure(exc: BaseException, cfg: MqttConfig) -> tuple[str, str]:
    """(short reason for metrics, one line for a person) for a failed connection."""
    where = f"{cfg.host}:{cfg.port}"
    text = str(exc) or type(exc).__name__
    if exc.__cause__ is not None and str(exc.__cause__) not in text:
        text += f" ({exc.__cause__})"
    if _is_auth_failure(exc):
        return "auth", (f"broker {where} refused the credentials ({exc}); check [mqtt] username and "
                        f"the password in password_file {cfg.password_file or '(none set)'}")
    if isinstance(exc, AlertsError):
        return "config", str(exc)
    if isinstance(exc, ssl.SSLError) or "ssl" in text.lower() or "certificate" in text.lower():
        return "tls", f"TLS with broker {where} failed: {text}"
    if "timed out" in text.lower() or isinstance(exc, TimeoutError):
        return "timeout", f"broker {where} did not answer in time: {text}"
    return "error", f"broker {where}: {text}"


async def _race(aw: Awaitable[T], watch: asyncio.Task[None]) -> T:
    """Await ``aw`` unless the connection watcher ends first (then raise its error)."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    await cancel_and_wait([task])
    watch.result()  # raises the MqttError that ended the connection
    raise aiomqtt.MqttError("the MQTT connection ended")


async def _watch(client: aiomqtt.Client) -> None:
    """Returns (raising MqttError) when the connection drops; we subscribe to nothing."""
    async for _ in client.messages:
        pass


# --------------------------------------------------------------------------- the alerter


class MqttAlerter:
    """An EventSink that publishes on-call alerts to MQTT from a task of its own."""

    def __init__(
        self,
        cfg: MqttConfig,
        *,
        host: str,
        instance: str,
        logger: FilteringBoundLogger | None = None,
        on_health: HealthCallback | None = None,
        clock: Callable[[], datetime] = utcnow,
        rng: random.Random | None = None,
    ) -> None:
        self._cfg = cfg
        self._host = host
        self._instance = instance
        self.topics = Topics.of(cfg.topic_prefix, host, instance)
        self.client_id = client_id(cfg, host, instance)
        self._log = logger if logger is not None else structlog.get_logger("supervisor.sinks.alerts")
        self._on_health = on_health
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._outbox: deque[Outgoing] = deque(maxlen=cfg.outbox_size)
        self._state_msg: Outgoing | None = None  # only the latest snapshot matters
        self._inflight: Outgoing | None = None
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        self._link = Reconnect(
            "mqtt", Backoff(initial=cfg.reconnect_initial_s, maximum=cfg.reconnect_max_s, factor=RECONNECT_FACTOR,
                            jitter=RECONNECT_JITTER),
            on_down=self._link_down, on_up=self._link_up, rng=self._rng, sleep=self._pause,
        )
        self._up = False  # the current session got as far as "online"
        self.connected = False
        self.sent = 0
        self.dropped = 0
        self.connect_failures = 0

    def __repr__(self) -> str:
        return (f"MqttAlerter(broker={self._cfg.host}:{self._cfg.port}, client_id={self.client_id!r}, "
                f"status={self.topics.status!r}, connected={self.connected}, pending={self.pending})")

    @property
    def running(self) -> bool:
        """True while the connection task is alive (it only ends through ``aclose``)."""
        return self._task is not None and not self._task.done()

    @property
    def pending(self) -> int:
        """Messages not yet acknowledged by the broker (events, in-flight, state)."""
        return len(self._outbox) + (self._inflight is not None) + (self._state_msg is not None)

    # ---- EventSink

    def emit(self, event: Event) -> None:
        """Queue the alert for ``event`` (if it is one); never blocks, never raises."""
        try:
            self._emit(event.kind, event.fields())
        except Exception as exc:  # a sink must not raise into a restart decision
            with contextlib.suppress(Exception):
                self._log.error("alert_emit_failed", alert_event=event.kind, error=repr(exc))

    def _emit(self, event: str, fields: Mapping[str, Any]) -> None:
        now = self._clock()
        if event == "state_changed":
            state = build_state(fields, host=self._host, instance=self._instance, ts=now)
            self._state_msg = Outgoing(self.topics.state, _dumps(state), self._cfg.qos, True, "state")
            self._wake.set()
        else:
            alert_id = str(uuid.uuid4())
            payload = build_alert(
                event, fields, host=self._host, instance=self._instance, ts=now, alert_id=alert_id,
                evidence_max_chars=self._cfg.evidence_max_chars,
            )
            if payload is not None:
                kind = payload["kind"]
                self._enqueue(Outgoing(self.topics.event(kind), _dumps(payload), self._cfg.qos, False, kind, alert_id))

    def _enqueue(self, msg: Outgoing) -> None:
        if len(self._outbox) == self._outbox.maxlen:
            self._drop(self._outbox[0])  # the append below pushes it out
        self._outbox.append(msg)
        self._wake.set()

    def _drop(self, msg: Outgoing) -> None:
        self.dropped += 1
        self._log.warning("alert_dropped", kind=msg.kind, id=msg.id, dropped_total=self.dropped,
                          reason=f"outbox full ({self._cfg.outbox_size}) while the broker is away")
        self._health("alert_dropped", msg.kind)

    def _health(self, kind: str, value: object) -> None:
        if self._on_health is None:
            return
        try:
            self._on_health(kind, value)
        except Exception as exc:  # metrics trouble must not stop alerting
            with contextlib.suppress(Exception):
                self._log.error("alert_health_callback_failed", kind=kind, error=repr(exc))

    # ---- lifecycle

    async def start(self) -> None:
        """Start the connection task (returns at once; connecting happens in the background)."""
        if self._task is not None:
            raise AlertsError("MqttAlerter already started")
        if self._cfg.tls and self._cfg.tls_insecure:
            self._log.warning("mqtt_tls_insecure", detail="server host name is not verified (tls_insecure = true)")
        if self._cfg.password_file and not self._cfg.username:
            self._log.warning("mqtt_password_without_username", detail="password_file is ignored without username")
        self._task = asyncio.create_task(self._run(), name="mqtt-alerts")

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued and a retained ``offline`` (within ``timeout_s``), then stop."""
        self._closing.set()
        self._wake.set()
        if self._task is None:
            return
        done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
        if not done:
            await cancel_and_wait([self._task], timeout_s=1.0)
        if self.pending:
            self._log.warning("alerts_undelivered", pending=self.pending, broker=f"{self._cfg.host}:{self._cfg.port}")

    async def offline_now(self, timeout_s: float) -> None:
        """The retained ``offline`` over a connection of its own, bounded by ``timeout_s``: for a
        daemon that must end now (its shutdown is overdue), whatever its own connection is doing.
        Raises what the broker or the network raised."""
        await within(_publish_once(self._cfg, f"{self.client_id}-last", self.topics.status, b"offline", retain=True,
                                   timeout_s=timeout_s, log=self._log), timeout_s)

    # ---- the connection loop

    async def _run(self) -> None:
        await self._link.run(self._try)

    async def _try(self) -> None:
        """One session; returns once closing (the loop ends), raises when it broke."""
        if self._closing.is_set():
            return
        try:
            await self._session()
        except Exception as exc:  # whatever went wrong, the alert task keeps going (Reconnect retries it)
            try:
                self._report(exc)
            except Exception as report_exc:
                self._log.error("mqtt_loop_error", error=repr(exc), report_error=repr(report_exc))
            raise

    async def _pause(self, delay: float) -> None:
        """The wait before the next try, cut short by a close."""
        with contextlib.suppress(TimeoutError):
            await within(self._closing.wait(), delay)

    def _report(self, exc: BaseException) -> None:
        """Every failed try is counted; the first of an outage is logged as a warning (an
        error when a person must fix something: the login, the config, TLS), the next ones
        at debug level: one line per outage."""
        reason, line = _failure(exc, self._cfg)
        first = not self._link.in_outage
        if self._up:
            self._log.warning("mqtt_disconnected", detail=line, pending=self.pending)
        else:
            self.connect_failures += 1
            event = "mqtt_auth_failed" if reason == "auth" else "mqtt_connect_failed"
            log = (self._log.error if reason in ("auth", "config", "tls") else self._log.warning) if first \
                else self._log.debug
            log(event, detail=line, attempt=self._link.attempt + 1, pending=self.pending)
            self._health("mqtt_connect_failed", reason)

    def _link_down(self, error: BaseException) -> None:
        self._health("link", LinkDown(link="mqtt", error=_failure(error, self._cfg)[1]))

    def _link_up(self, down_s: float | None) -> None:
        cfg = self._cfg
        self._log.info("mqtt_connected", broker=f"{cfg.host}:{cfg.port}", client_id=self.client_id,
                       pending=self.pending, down_s=down_s)
        self._health("link", LinkUp(link="mqtt", down_s=down_s))

    def _set_connected(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            self._health("mqtt_connected", connected)

    async def _session(self) -> None:
        """One connection: online, drain until closing, offline. Raises when it breaks."""
        cfg = self._cfg
        client = _make_client(
            cfg, identifier=self.client_id, password=await _password(cfg, self._log, self._warned),
            will=aiomqtt.Will(self.topics.status, b"offline", qos=1, retain=True), timeout=cfg.connect_timeout_s,
        )
        self._up = False
        await _open(client)
        watch = asyncio.create_task(_watch(client))
        try:
            self._link.connected()
            await _race(self._publish(client, self.topics.status, b"online", qos=1, retain=True), watch)
            self._up = True
            self._set_connected(True)
            await self._drain(client, watch)
            await _race(self._publish(client, self.topics.status, b"offline", qos=1, retain=True), watch)
        finally:
            await cancel_and_wait([watch])
            await _close(client)
            self._set_connected(False)

    def _publish(self, client: aiomqtt.Client, topic: str, payload: bytes, *, qos: int, retain: bool) -> Awaitable[None]:
        return client.publish(topic, payload, qos=qos, retain=retain, timeout=self._cfg.connect_timeout_s)

    async def _drain(self, client: aiomqtt.Client, watch: asyncio.Task[None]) -> None:
        """Publish queued messages in order, one acknowledged at a time, until closing."""
        while True:
            msg = self._take()
            if msg is None:
                if self._closing.is_set():
                    return
                self._wake.clear()
                await _race(self._wake.wait(), watch)
                continue
            try:
                await _race(self._publish(client, msg.topic, msg.payload, qos=msg.qos, retain=msg.retain), watch)
            except BaseException:
                self._requeue(msg)
                raise
            self._inflight = None
            if msg.kind != "state":
                self.sent += 1
                self._health("alert_sent", msg.kind)

    def _take(self) -> Outgoing | None:
        if self._outbox:
            self._inflight = self._outbox.popleft()
        elif self._state_msg is not None:
            self._inflight, self._state_msg = self._state_msg, None
        return self._inflight

    def _requeue(self, msg: Outgoing) -> None:
        """Put an unacknowledged message back at the head (a newer state snapshot wins)."""
        self._inflight = None
        if msg.kind == "state":
            if self._state_msg is None:
                self._state_msg = msg
        elif len(self._outbox) == self._outbox.maxlen:
            self._drop(msg)  # it is the oldest of them all
        else:
            self._outbox.appendleft(msg)


# --------------------------------------------------------------------------- the drill


@dataclass(frozen=True, slots=True)
class DrillResult:
    """Whether the broker acknowledged a drill alert."""

    acknowledged: bool
    detail: str
    topic: str


async def drill(
    cfg: MqttConfig,
    *,
    host: str,
    instance: str,
    timeout_s: float = 10.0,
    logger: FilteringBoundLogger | None = None,
    clock: Callable[[], datetime] = utcnow,
) -> DrillResult:
    """Publish one ``drill`` alert (QoS >= 1) and report whether the broker acknowledged it.

    Each step (connect, TLS, CONNACK, PUBACK) waits at most ``timeout_s``. The drill uses
    its own client id and no Will, so it never disturbs a running daemon's connection.
    """
    log = logger if logger is not None else structlog.get_logger("supervisor.sinks.alerts")
    topic = Topics.of(cfg.topic_prefix, host, instance).event(DRILL)
    alert_id = str(uuid.uuid4())
    payload = build_alert(DRILL, {}, host=host, instance=instance, ts=clock(), alert_id=alert_id,
                          evidence_max_chars=cfg.evidence_max_chars)
    assert payload is not None
    try:
        await _publish_once(cfg, f"{client_id(cfg, host, instance)}-drill-{alert_id[:8]}", topic, _dumps(payload),
                            retain=False, timeout_s=timeout_s, log=log)
    except (aiomqtt.MqttError, AlertsError, OSError, ssl.SSLError) as exc:
        return DrillResult(False, _failure(exc, cfg)[1], topic)
    return DrillResult(True, f"broker {cfg.host}:{cfg.port} acknowledged drill {alert_id}", topic)


async def _publish_once(cfg: MqttConfig, identifier: str, topic: str, payload: bytes, *, retain: bool,
                        timeout_s: float, log: FilteringBoundLogger) -> None:
    """One message (QoS >= 1) over a connection of its own, with no Will: connect, publish,
    wait for the broker's acknowledgement, disconnect. Each step waits at most ``timeout_s``."""
    client = _make_client(cfg, identifier=identifier, password=await _password(cfg, log, set()), will=None,
                          timeout=timeout_s)
    await _open(client)
    try:
        await client.publish(topic, payload, qos=max(1, cfg.qos), retain=retain, timeout=timeout_s)
    finally:
        await _close(client)
