"""Test helpers for MQTT: a real mosquitto broker, a black-hole listener and a subscriber.

``Broker`` runs ``/usr/sbin/mosquitto -c <conf>`` on a fixed free 127.0.0.1 port inside a
temporary directory, optionally with a password file (made by ``mosquitto_passwd -b``),
TLS, and on-disk persistence (so a persistent subscriber session survives a broker
restart). It can be stopped and started again on the same port to play a flapping broker,
and it is always stopped (and reaped) on exit.

``BlackHole`` is a TCP listener that completes the handshake and never answers: the
"broker that swallows connections" case.

``Collector`` is a subscriber that reconnects on its own and records every message, so a
test can wait for what it expects with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiomqtt

from tests.conftest import free_port, require_binary
from tests.servicelib import LocalService


@dataclass(frozen=True)
class TlsFiles:
    """A CA and a server certificate signed by it, as PEM files."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_tls_files(directory: Path, *, server_name: str = "localhost") -> TlsFiles:
    """Make a throwaway CA and a server certificate for ``server_name`` with the openssl CLI."""
    openssl = require_binary("openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = directory / "ca.key", directory / "ca.pem"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.pem"
    ext = directory / "server.ext"
    ext.write_text(f"subjectAltName=DNS:{server_name}\nbasicConstraints=CA:FALSE\n")

    def sh(*argv: str | Path) -> None:
        subprocess.run([openssl, *map(str, argv)], check=True, capture_output=True, timeout=60)

    sh("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
       "-keyout", ca_key, "-out", ca_cert)
    sh("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={server_name}",
       "-keyout", key, "-out", csr)
    sh("x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial",
       "-days", "2", "-extfile", ext, "-out", cert)
    return TlsFiles(ca_cert=ca_cert, server_cert=cert, server_key=key)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class Broker(LocalService):
    """A mosquitto process on 127.0.0.1:``port`` that can be stopped and started again."""

    host = "127.0.0.1"
    what = "mosquitto"

    def __init__(
        self,
        directory: Path,
        *,
        users: dict[str, str] | None = None,
        tls: TlsFiles | None = None,
        persistent: bool = False,
    ) -> None:
        self.binary = require_binary("mosquitto")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_file = directory / "mosquitto.log"
        self.conf = directory / "mosquitto.conf"
        super().__init__([self.binary, "-c", str(self.conf)], self.log_file, output_to_log=False)
        lines = [
            f"listener {self.port} {self.host}",
            # Running as root, mosquitto would switch to the "mosquitto" user and lose
            # access to the temporary directory.
            "user root",
            f"log_dest file {self.log_file}",
            "log_type all",
            "connection_messages true",
        ]
        if users:
            passwd = require_binary("mosquitto_passwd")
            pw_file = directory / "passwd"
            for i, (user, password) in enumerate(users.items()):
                flags = ["-c"] if i == 0 else []
                subprocess.run([passwd, *flags, "-b", str(pw_file), user, password],
                               check=True, capture_output=True, timeout=30)
            lines += ["allow_anonymous false", f"password_file {pw_file}"]
        else:
            lines.append("allow_anonymous true")
        if tls:
            lines += [f"cafile {tls.ca_cert}", f"certfile {tls.server_cert}", f"keyfile {tls.server_key}"]
        if persistent:
            lines += ["persistence true", f"persistence_location {directory}/", "autosave_interval 1"]
        self.conf.write_text("\n".join(lines) + "\n")

    def ready(self) -> bool:
        """It accepts TCP connections."""
        return _accepts(self.host, self.port)

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BlackHole:
    """A TCP listener that completes every handshake and never sends a byte.

    The kernel accepts connections into the listen backlog on our behalf; nothing ever
    reads or answers them, exactly like a broker host that swallows connections.
    """

    host = "127.0.0.1"

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind((self.host, 0))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]

    def has_pending_connection(self) -> bool:
        """True once a client has connected (a connection waits in the backlog)."""
        import select

        readable, _, _ = select.select([self._sock], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Received:
    """One message a ``Collector`` saw."""

    topic: str
    payload: bytes
    retain: bool
    qos: int

    def json(self) -> Any:
        return json.loads(self.payload)


class Collector:
    """A subscriber that keeps reconnecting and records every message it receives.

    With ``persistent=True`` it uses a fixed client id and a persistent session, so a
    broker with persistence queues QoS 1 messages for it while it is away.
    """

    def __init__(self, broker: Broker, topic: str, *, persistent: bool = False, **client_kw: Any) -> None:
        self.broker = broker
        self.topic = topic
        self.persistent = persistent
        self.client_kw = client_kw
        self.messages: list[Received] = []
        self.subscriptions = 0  # how many times it has (re)subscribed
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._id = f"collector-{id(self):x}"

    async def _run(self) -> None:
        while True:
            try:
                async with aiomqtt.Client(
                    self.broker.host, self.broker.port, identifier=self._id,
                    clean_session=not self.persistent, timeout=10, **self.client_kw,
                ) as client:
                    await client.subscribe(self.topic, qos=1)
                    self.subscriptions += 1
                    self._changed.set()
                    async for m in client.messages:
                        self.messages.append(Received(str(m.topic), bytes(m.payload), m.retain, m.qos))
                        self._changed.set()
            except aiomqtt.MqttError:
                await asyncio.sleep(0.1)  # reconnect pacing while the broker is away

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0, what: str = "messages") -> Any:
        """Wait until ``predicate()`` is truthy (re-checked on every new message)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (value := predicate()):
            self._changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                got = [(m.topic, m.payload[:200]) for m in self.messages]
                raise AssertionError(f"timed out after {timeout} s waiting for {what}; got {got}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return value

    def on(self, suffix: str) -> list[Received]:
        """The messages whose topic ends with ``suffix``."""
        return [m for m in self.messages if m.topic.endswith(suffix)]

    async def __aenter__(self) -> Collector:
        self._task = asyncio.create_task(self._run())
        await self.wait_for(lambda: self.subscriptions > 0, what="the collector to subscribe")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def retained(broker: Broker, topic_filter: str, **client_kw: Any) -> dict[str, Received]:
    """The retained messages under ``topic_filter``, read by a fresh subscriber.

    A sentinel published after subscribing marks the end of the retained burst, so no
    fixed wait is needed.
    """
    sentinel = f"test-sentinel/{time.monotonic_ns()}"
    found: dict[str, Received] = {}
    async with aiomqtt.Client(broker.host, broker.port, timeout=10, **client_kw) as client:
        await client.subscribe(topic_filter, qos=1)
        await client.subscribe(sentinel, qos=1)
        await client.publish(sentinel, b"end", qos=1)
        async with asyncio.timeout(30):
            async for m in client.messages:
                if str(m.topic) == sentinel:
                    break
                found[str(m.topic)] = Received(str(m.topic), bytes(m.payload), m.retain, m.qos)
    return found

