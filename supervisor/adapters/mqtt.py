"""The MQTT transport of the on-call alerts: a bounded outbox and the broker connection.

The alerts sink (``supervisor.sinks.alerts``) words the events and hands this adapter
finished messages (topic, payload, QoS, retain) through its ``Outbox`` protocol: ``send``
for an alert, ``latest`` for the retained state snapshot. Both are synchronous and O(1):
an alert is appended to a bounded outbox (the oldest is dropped, counted and logged when it
is full); a snapshot replaces the one not yet delivered (only the newest matters).

A task of its own owns the broker connection (aiomqtt has no reconnect of its own): connect
with a Last Will of ``offline`` on the status topic, publish a retained ``online``, drain
the outbox, and on any failure reconnect. A message leaves the outbox only once the broker
acknowledged it, so delivery is at least once; the payload's ``id`` (the sink's) lets
consumers drop duplicates. A clean stop publishes a retained ``offline``.

The reconnects are ``supervisor.aio.Reconnect``'s, the same as every link's: the restart
policy's backoff, and one line per outage (each further failed try is a debug line, and
counted). The password is read from ``password_file`` at each connect and handed to the
client only: it is never stored on the transport, logged, or put in a repr or an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import ssl
import stat
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiomqtt
import structlog
from aiomqtt.exceptions import MqttConnectError
from structlog.typing import FilteringBoundLogger

from supervisor.aio import Backoff, Reconnect, cancel_and_wait, within
from supervisor.core.config import MqttConfig
from supervisor.core.events import LinkDown, LinkUp

T = TypeVar("T")

# paho's own (debug) log lines go here; they carry flags, never the password.
_PAHO_LOG = logging.getLogger("supervisor.adapters.mqtt.paho")

HealthCallback = Callable[[str, object], None]
"""``on_health(kind, value)``: ("alert_sent", alert kind), ("alert_dropped", alert kind),
("mqtt_connected", bool), ("mqtt_connect_failed", short reason), ("link", a ``LinkDown`` or
``LinkUp`` of link ``mqtt``: once per outage)."""

# Reconnects (supervisor.aio.Reconnect) wait backoff.exponential_backoff: doubling from [mqtt] reconnect_initial_s up to
# reconnect_max_s, each wait jittered to [d/2, d] so that many daemons do not reconnect in step.
RECONNECT_FACTOR = 2.0
RECONNECT_JITTER = (0.5, 1.0)

STATE = "state"  # the kind of the retained snapshot in the outbox (an alert's is its alert kind)


class MqttAdapterError(Exception):
    """The MQTT adapter's own error (unreadable password file, lost connection, misuse)."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message waiting for the broker."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    kind: str  # alert kind, or STATE
    id: str | None = None


# --------------------------------------------------------------------------- client plumbing


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
        raise MqttAdapterError(
            f"cannot read [mqtt] password_file {cfg.password_file}: {exc.strerror or type(exc).__name__}"
        ) from None
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


def failure(exc: BaseException, cfg: MqttConfig) -> tuple[str, str]:
    """(short reason for metrics, one line for a person) for a failed connection."""
    where = f"{cfg.host}:{cfg.port}"
    text = str(exc) or type(exc).__name__
    if exc.__cause__ is not None and str(exc.__cause__) not in text:
        text += f" ({exc.__cause__})"
    if _is_auth_failure(exc):
        return "auth", (f"broker {where} refused the credentials ({exc}); check [mqtt] username and "
                        f"the password in password_file {cfg.password_file or '(none set)'}")
    if isinstance(exc, MqttAdapterError):
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


# What a one-off publish (``publish_once``) raises when the broker or the network refuses it.
PUBLISH_ERRORS: tuple[type[BaseException], ...] = (aiomqtt.MqttError, MqttAdapterError, OSError, ssl.SSLError)


async def publish_once(cfg: MqttConfig, identifier: str, topic: str, payload: bytes, *, retain: bool,
                       timeout_s: float, log: FilteringBoundLogger) -> None:
    """One message (QoS >= 1) over a connection of its own, with no Will: connect, publish,
    wait for the broker's acknowledgement, disconnect. Each step waits at most ``timeout_s``.
    Raises one of ``PUBLISH_ERRORS`` (``failure`` words it) when it was not acknowledged."""
    client = _make_client(cfg, identifier=identifier, password=await _password(cfg, log, set()), will=None,
                          timeout=timeout_s)
    await _open(client)
    try:
        await client.publish(topic, payload, qos=max(1, cfg.qos), retain=retain, timeout=timeout_s)
    finally:
        await _close(client)


# --------------------------------------------------------------------------- the transport


class MqttTransport:
    """The alerts' outbox and the task that delivers it to the broker (the sink's ``Outbox``)."""

    def __init__(
        self,
        cfg: MqttConfig,
        *,
        client_id: str,
        status_topic: str,
        logger: FilteringBoundLogger | None = None,
        on_health: HealthCallback | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._cfg = cfg
        self.client_id = client_id
        self.status_topic = status_topic  # the Will's, online's and offline's
        self._log = logger if logger is not None else structlog.get_logger("supervisor.adapters.mqtt")
        self._on_health = on_health
        self._rng = rng if rng is not None else random.Random()
        self._outbox: deque[Outgoing] = deque(maxlen=cfg.outbox_size)
        self._state_msg: Outgoing | None = None  # only the latest snapshot matters
        self._inflight: Outgoing | None = None
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._say_offline = True  # a close publishes the retained ``offline`` (not a re-exec's)
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
        return (f"MqttTransport(broker={self._cfg.host}:{self._cfg.port}, client_id={self.client_id!r}, "
                f"status={self.status_topic!r}, connected={self.connected}, pending={self.pending})")

    @property
    def running(self) -> bool:
        """True while the connection task is alive (it only ends through ``aclose``)."""
        return self._task is not None and not self._task.done()

    @property
    def pending(self) -> int:
        """Messages not yet acknowledged by the broker (alerts, in-flight, state)."""
        return len(self._outbox) + (self._inflight is not None) + (self._state_msg is not None)

    # ---- the Outbox (supervisor.sinks.alerts)

    def send(self, topic: str, payload: bytes, *, qos: int, retain: bool, kind: str, alert_id: str) -> None:
        """Queue an alert for delivery, in order; never blocks (a full outbox drops its oldest)."""
        msg = Outgoing(topic, payload, qos, retain, kind, alert_id)
        if len(self._outbox) == self._outbox.maxlen:
            self._drop(self._outbox[0])  # the append below pushes it out
        self._outbox.append(msg)
        self._wake.set()

    def latest(self, topic: str, payload: bytes, *, qos: int, retain: bool) -> None:
        """The newest snapshot, replacing the one not yet delivered; never blocks."""
        self._state_msg = Outgoing(topic, payload, qos, retain, STATE)
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
            raise MqttAdapterError("MqttTransport already started")
        if self._cfg.tls and self._cfg.tls_insecure:
            self._log.warning("mqtt_tls_insecure", detail="server host name is not verified (tls_insecure = true)")
        if self._cfg.password_file and not self._cfg.username:
            self._log.warning("mqtt_password_without_username", detail="password_file is ignored without username")
        self._task = asyncio.create_task(self._run(), name="mqtt-alerts")

    async def aclose(self, timeout_s: float = 5.0, *, offline: bool = True) -> None:
        """Deliver what is queued and a retained ``offline`` (within ``timeout_s``), then stop.
        ``offline`` False (a re-exec): no ``offline``, and a clean DISCONNECT, so the broker
        does not fire the Last Will either; the next program says ``online`` again."""
        self._say_offline = offline
        self._closing.set()
        self._wake.set()
        if self._task is None:
            return
        done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
        if not done:
            await cancel_and_wait([self._task], timeout_s=1.0)
        if self.pending:
            self._log.warning("alerts_undelivered", pending=self.pending, broker=f"{self._cfg.host}:{self._cfg.port}")

    async def restart(self) -> None:
        """Connect again after ``aclose`` (a re-exec whose exec failed)."""
        if self.running:
            return
        self._closing.clear()
        self._say_offline = True
        self._task = None
        await self.start()

    async def offline_now(self, timeout_s: float) -> None:
        """The retained ``offline`` over a connection of its own, bounded by ``timeout_s``: for a
        daemon that must end now (its shutdown is overdue), whatever its own connection is doing.
        Raises what the broker or the network raised."""
        await within(publish_once(self._cfg, f"{self.client_id}-last", self.status_topic, b"offline", retain=True,
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
        reason, line = failure(exc, self._cfg)
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
        self._health("link", LinkDown(link="mqtt", error=failure(error, self._cfg)[1]))

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
            will=aiomqtt.Will(self.status_topic, b"offline", qos=1, retain=True), timeout=cfg.connect_timeout_s,
        )
        self._up = False
        await _open(client)
        watch = asyncio.create_task(_watch(client))
        try:
            self._link.connected()
            await _race(self._publish(client, self.status_topic, b"online", qos=1, retain=True), watch)
            self._up = True
            self._set_connected(True)
            await self._drain(client, watch)
            if self._say_offline:
                await _race(self._publish(client, self.status_topic, b"offline", qos=1, retain=True), watch)
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
            if msg.kind != STATE:
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
        if msg.kind == STATE:
            if self._state_msg is None:
                self._state_msg = msg
        elif len(self._outbox) == self._outbox.maxlen:
            self._drop(msg)  # it is the oldest of them all
        else:
            self._outbox.appendleft(msg)
