"""The metrics endpoint: every server's registry served over HTTP (``[metrics] listen``).

The exporter is prometheus_client's WSGI app on a threaded HTTP server, bound to exactly the
configured host: a scrape runs in its own thread and never waits on the event loop, so it
cannot delay a restart decision. The server's thread sleeps until a scrape or the close
wakes it (``prometheus_client.start_http_server``'s thread wakes twice a second to see
whether it should stop, scraped or not). ``labelled_registry`` serves several servers'
registries (each ``supervisor.sinks.metrics.Metrics`` keeps its own) as one exposition,
with a ``server`` label on every sample.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric

from supervisor.core.config import url_host


class MetricsError(Exception):
    """The metrics endpoint could not be served (bad address, port taken)."""


class ServerLabels:
    """One exposition of several servers' metrics: each server's ``Metrics`` keeps its own
    registry, and this collector serves them all with a ``server`` label on every sample
    (one family per metric name, as the text format wants). A daemon with one ``[server]``
    serves it the same way, so the dashboard's row per server works for one and for many.
    """

    def __init__(self, registries: Mapping[str, CollectorRegistry]) -> None:
        self._registries = dict(registries)

    def describe(self) -> list[Metric]:
        return []  # no fixed set: the families are read at each scrape

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for server, registry in self._registries.items():
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples.extend(
                    sample._replace(labels={**sample.labels, "server": server}) for sample in family.samples
                )
        return list(merged.values())


def labelled_registry(registries: Mapping[str, CollectorRegistry]) -> CollectorRegistry:
    """The registry to serve: every server's metrics under a ``server`` label."""
    exported = CollectorRegistry(auto_describe=False)
    exported.register(ServerLabels(registries))
    return exported


class _Exporter(ThreadingMixIn, WSGIServer):
    """One thread per scrape; the address family the host asks for (an IPv6 host too)."""

    daemon_threads = True  # a scrape's thread is not joined at close
    timeout = 0  # ``handle_request`` runs only once the socket is readable: it never waits

    def __init__(self, host: str, port: int, app: Any) -> None:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self.address_family = family
        super().__init__((str(address[0]), port), _Quiet)
        self.set_app(app)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """A scrape is not logged."""


def _serve(server: _Exporter, wake: int) -> None:
    """The server's thread: asleep until a scrape arrives or ``wake`` is readable (the close)."""
    with selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ)
        selector.register(wake, selectors.EVENT_READ)
        while True:
            ready = selector.select()
            if any(key.fd == wake for key, _ in ready):
                return
            server.handle_request()


@dataclass(slots=True)
class MetricsServer:
    """A running metrics endpoint; ``port`` is the bound one (useful with port 0)."""

    host: str
    port: int
    _server: _Exporter
    _thread: threading.Thread
    _wake: tuple[int, int]  # the pipe that ends the server's thread

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}/metrics"  # where it listens, a wildcard too

    async def close(self) -> None:
        """Stop serving and join the server thread (off the event loop)."""
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        read, write = self._wake
        os.write(write, b"x")
        self._thread.join(timeout=10.0)
        self._server.server_close()
        os.close(read)
        os.close(write)


def parse_listen(listen: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::1]:PORT"`` for IPv6) as (host, port); MetricsError if bad."""
    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise MetricsError(f"metrics.listen = {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:9188")
    return host, int(port)


async def start_metrics_server(listen: str, registry: CollectorRegistry) -> MetricsServer:
    """Serve ``registry`` on exactly ``listen`` in a thread of its own; MetricsError if not."""
    host, port = parse_listen(listen)
    try:
        server = await asyncio.to_thread(_Exporter, host, port, make_wsgi_app(registry))
    except (OSError, ValueError) as exc:  # taken port, unknown host, bad address
        raise MetricsError(f"cannot serve metrics on {listen}: {exc}") from exc
    wake = os.pipe()
    thread = threading.Thread(target=_serve, args=(server, wake[0]), name="metrics", daemon=True)
    thread.start()
    return MetricsServer(host, int(server.server_address[1]), server, thread, wake)
