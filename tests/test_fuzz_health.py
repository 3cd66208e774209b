"""Fuzzed health answers: ``HealthProber.probe()`` always returns, within its timeout.

A raw asyncio TCP server on a free port answers the probe's GET with garbage (hypothesis),
a status line trickled a byte at a time, a 50 MB body, a header that never ends, endless
headers, a silent socket, a reset. Whatever it is, the probe returns an outcome (failed,
unless it really was a 200) before its timeout plus a margin, and reads a bounded body: a
health check must never become a stuck loop or a memory sink.

Decision: a ``200`` whose body is huge is healthy (SGLang's /health body means nothing); the
probe reads at most ``health.MAX_BODY`` bytes of it and drops the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.adapters.health import MAX_BODY, HealthProber, ProbeOutcome

TIMEOUT_S = 1.0
MARGIN_S = 5.0  # a deadline for "it returned", not a timing claim
Writer = Callable[[asyncio.StreamWriter], Awaitable[None]]


class Answer:
    """How the fake server answers one request; counts what it managed to send."""

    def __init__(self, write: Writer) -> None:
        self.write = write
        self.sent = 0


async def probe_against(answer: Answer) -> ProbeOutcome:
    """Serve ``answer`` on a free port and probe it once (bounded by a deadline)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            await answer.write(writer)
        with contextlib.suppress(Exception):
            writer.close()
            await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    prober = HealthProber(f"http://127.0.0.1:{port}/health", TIMEOUT_S)
    try:
        return await asyncio.wait_for(prober.probe(), TIMEOUT_S + MARGIN_S)
    finally:
        await prober.aclose()
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


def once(data: bytes) -> Answer:
    """``data`` once, then the connection is closed."""

    async def write(w: asyncio.StreamWriter) -> None:
        w.write(data)
        await w.drain()

    return Answer(write)


def forever(head: bytes, piece: bytes, pause_s: float = 0.0) -> Answer:
    """``head``, then ``piece`` again and again until the client goes away."""
    answer: Answer

    async def write(w: asyncio.StreamWriter) -> None:
        w.write(head)
        answer.sent += len(head)
        while True:
            w.write(piece)
            answer.sent += len(piece)
            await w.drain()  # raises once the client has closed the connection
            if pause_s:
                await asyncio.sleep(pause_s)

    answer = Answer(write)
    return answer


def silent() -> Answer:
    """Read the request, then say nothing for an hour."""

    async def write(_w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    return Answer(write)


def run(answer: Answer) -> ProbeOutcome:
    """One probe against ``answer`` in a fresh event loop."""
    return asyncio.run(probe_against(answer))


# --- hypothesis: anything that is not an HTTP response ----------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=4096).filter(lambda b: not b.startswith(b"HTTP/")))
def test_garbage_is_a_failed_probe(data: bytes) -> None:
    """Bytes that are not an HTTP response: a failed probe, never an exception or a hang."""
    outcome = run(once(data))
    assert not outcome.ok and outcome.status is None


@settings(max_examples=60, deadline=None)
@given(
    status=st.integers(0, 999),
    reason=st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b),
    headers=st.lists(st.binary(max_size=200).filter(lambda b: b"\n" not in b), max_size=8),
    body=st.binary(max_size=2048),
)
def test_malformed_responses_never_fake_health(status: int, reason: bytes, headers: list[bytes], body: bytes) -> None:
    """Random status lines, header lines and bodies: healthy only for a real 200."""
    data = b"HTTP/1.1 %d " % status + reason + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body
    outcome = run(once(data))
    assert not outcome.ok or outcome.status == 200


# --- the named nasty answers ------------------------------------------------------------------

HEAD_200 = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
FIFTY_MB = 50 * 1024 * 1024

NASTY: dict[str, tuple[Callable[[], Answer], bool]] = {
    # name: (answer, healthy?)
    "status_line_trickled": (lambda: forever(b"", b"H", 0.05), False),
    "headers_trickled": (lambda: forever(HEAD_200, b"X", 0.05), False),
    "header_that_never_ends": (lambda: forever(HEAD_200 + b"X-Long: ", b"a" * 65536), False),
    "endless_headers": (lambda: forever(HEAD_200, b"X-Again: yes\r\n" * 1000), False),
    "silent_after_request": (silent, False),
    "content_length_never_sent": (lambda: once(HEAD_200 + b"Content-Length: 100\r\n\r\n"), False),
    "503_with_50_mb_body": (lambda: forever(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n" % FIFTY_MB, b"z" * 65536), False),
    "200_with_50_mb_body": (lambda: forever(HEAD_200 + b"Content-Length: %d\r\n\r\n" % FIFTY_MB, b"z" * 65536), True),
    "200_with_endless_chunks": (lambda: forever(HEAD_200 + b"Transfer-Encoding: chunked\r\n\r\n", b"10000\r\n" + b"c" * 65536 + b"\r\n"), True),
    "redirect": (lambda: once(b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/\r\nContent-Length: 0\r\n\r\n"), False),
    "closed_without_answer": (lambda: once(b""), False),
}


@pytest.mark.parametrize("name", list(NASTY))
def test_nasty_answers_return_within_the_timeout(name: str) -> None:
    """Trickles, endless headers, silence and huge bodies: the probe returns before its
    timeout plus a margin; only a real 200 counts as healthy; a huge body is not read whole."""
    make, healthy = NASTY[name]
    answer = make()
    outcome = run(answer)
    assert outcome.ok is healthy, outcome
    if not healthy:
        assert outcome.detail
    assert answer.sent < FIFTY_MB // 2 + MAX_BODY  # the probe hung up long before the end
