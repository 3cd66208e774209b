"""The one way the adapters speak HTTP: HTTP/1.1 by h11 over an asyncio stream, one fresh
connection per exchange, a total deadline, a bounded head and a bounded body. Shared by the
health prober, the KV reader and the router client; the adapters' independence contract
(pyproject.toml) shares this module, ``output`` and ``ports``.

Why h11 and not aiohttp (issue 36, ``python -m bench.bench_http``): the daemon only ever
sends one small request and reads one bounded answer, on a connection it closes at once (a
wedged or stale keep-alive socket must never fake an answer or cost a failed call). aiohttp's
client is 14 MB of the daemon's RSS for that; h11 (python-hyper's sans-I/O HTTP/1.1, what
httpcore and uvicorn are built on) is a parser and nothing else, and the rest here is the
exchange itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import h11

# The status line and headers together (h11's bound on an incomplete event): SGLang's and
# the router's heads are a few hundred bytes; an endless or trickled head is a failed call.
MAX_HEAD = 16 * 1024
READ_SIZE = 64 * 1024
USER_AGENT = "sglang-supervisor"


class HttpError(Exception):
    """An exchange that failed other than by its deadline: the server broke HTTP, closed the
    connection mid-answer, or reset it. ``str()`` is one short line."""


class ConnectError(HttpError):
    """No connection: refused, unreachable, no such host. ``errno`` when the OS gave one."""

    def __init__(self, message: str, errno: int | None) -> None:
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True, slots=True)
class Url:
    scheme: str  # "http" or "https"
    host: str  # without brackets
    port: int
    netloc: str  # host[:port] as the Host header and messages show it (no credentials)
    target: str  # the path and query sent in the request line

    @property
    def base(self) -> str:
        """``scheme://netloc``: what a message may show."""
        return f"{self.scheme}://{self.netloc}"

    @property
    def path(self) -> str:
        """The target's path, without its query."""
        return self.target.partition("?")[0]

    def at(self, target: str) -> Url:
        """The same server, another target."""
        return replace(self, target=target)


def parse_url(url: str) -> Url:
    """An http(s) URL, split; ``ValueError`` (one line) for anything else. Credentials are
    dropped: they are never sent and never shown."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s)://host[:port] URL")
    port = parts.port  # ValueError for a port that is not a number in range
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    netloc = shown if port is None else f"{shown}:{port}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Url(parts.scheme, host, port or (443 if parts.scheme == "https" else 80), netloc, target)


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes  # at most ``max_body`` bytes of it
    complete: bool  # False: the body went on past ``max_body`` and was not read


async def request(url: Url, method: str = "GET", *, timeout_s: float, max_body: int,
                  headers: tuple[tuple[str, str], ...] = (), body: bytes | None = None) -> Response:
    """One exchange on a connection of its own, within ``timeout_s`` in all (``TimeoutError``).
    At most ``max_body`` bytes of the answer are read; the connection is closed either way."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await _connect(url)
        try:
            return await _exchange(reader, writer, url, method, headers, body, max_body)
        finally:
            writer.transport.abort()  # Connection: close; nothing of ours is left to flush


async def _connect(url: Url) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    tls = None
    if url.scheme == "https":
        import ssl  # only a router behind TLS needs it (3 MB)

        tls = ssl.create_default_context()
    try:
        return await asyncio.open_connection(url.host, url.port, ssl=tls, limit=READ_SIZE)
    except OSError as exc:
        raise ConnectError(exc.strerror or str(exc) or type(exc).__name__, exc.errno) from None


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, url: Url, method: str,
                    headers: tuple[tuple[str, str], ...], body: bytes | None, max_body: int) -> Response:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    head = [("Host", url.netloc), ("User-Agent", USER_AGENT), ("Connection", "close"), *headers]
    if body is not None:
        head.append(("Content-Length", str(len(body))))
    try:
        out = conn.send(h11.Request(method=method, target=url.target, headers=head))
        if body is not None:
            out = (out or b"") + (conn.send(h11.Data(data=body)) or b"")
        out = (out or b"") + (conn.send(h11.EndOfMessage()) or b"")
        writer.write(out)
        await writer.drain()
        status: int | None = None
        chunks: list[bytes] = []
        size = 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(READ_SIZE))  # b"": the server closed
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if size + len(event.data) > max_body:
                    chunks.append(event.data[:max_body - size])
                    assert status is not None
                    return Response(status, b"".join(chunks), complete=False)
                chunks.append(event.data)
                size += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert status is not None
                return Response(status, b"".join(chunks), complete=True)
            elif isinstance(event, h11.ConnectionClosed):
                raise HttpError("the connection closed before an answer")
            # an InformationalResponse (1xx) is followed by the real one: read on
    except h11.ProtocolError as exc:
        raise HttpError(f"not an HTTP answer: {one_line(str(exc), 200)}") from None
    except OSError as exc:  # reset, broken pipe
        raise HttpError(exc.strerror or type(exc).__name__) from None


def one_line(text: str, limit: int | None = None) -> str:
    """``text`` on one line (white space runs as one space), cut to ``limit`` characters and
    ``...`` when longer; for messages that quote what a server said."""
    text = " ".join(text.split())
    return text if limit is None or len(text) <= limit else text[:limit] + "..."

