"""The daemon's control socket: a Unix socket in the state directory for operator commands.

One JSON object per connection, one JSON answer line, then the connection closes; an answer
may be followed by more lines on the same connection (``ControlReply``). Today's one command
is ``{"cmd": "restart", "reason": "...", "wait": true}`` (``sglang-supervisor restart``): the
daemon drains, stops and relaunches its servers one at a time with the current flags; with
``wait`` it writes each step of the pass as it happens and, last, how the pass ended. The
socket is made with mode 0600 inside the state directory, so only the daemon's own user can
use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any

from supervisor.adapters.ports import ControlError, ControlHandler, ControlReply
from supervisor.aio import within

SOCKET_NAME = "control.sock"
MAX_REQUEST = 4096
# sockaddr_un.sun_path is 108 bytes with its terminating NUL.
MAX_PATH = 107


def socket_path(state_dir: str) -> Path:
    return Path(state_dir) / SOCKET_NAME


class ControlServer:
    def __init__(self, server: asyncio.AbstractServer, path: Path) -> None:
        self._server = server
        self.path = path

    @classmethod
    async def start(cls, path: Path, handler: ControlHandler) -> ControlServer:
        if len(os.fsencode(path)) > MAX_PATH:
            raise ControlError(f"{path}: path too long for a Unix socket ({len(os.fsencode(path))} > {MAX_PATH})")

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            reply: ControlReply | None = None
            try:
                raw = await within(reader.readline(), 5.0)
                try:
                    request = json.loads(raw[:MAX_REQUEST] or b"null")
                except ValueError:
                    request = None
                answer = handler(request) if isinstance(request, dict) else {
                    "ok": False, "error": "expected one JSON object"}
                if isinstance(answer, ControlReply):
                    reply, answer = answer, answer.answer
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
                if reply is not None:
                    async for line in reply.then:
                        writer.write(json.dumps(line).encode() + b"\n")
                        await writer.drain()
            except (TimeoutError, ConnectionError):
                pass
            finally:
                if reply is not None:
                    reply.close()
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()

        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket left by a daemon that died (the store's lock says we own the dir)
        old = os.umask(0o077)
        try:
            server = await asyncio.start_unix_server(serve, path=str(path))
        except OSError as exc:
            raise ControlError(f"{path}: cannot listen: {exc.strerror or exc}") from None
        finally:
            os.umask(old)
        return cls(server, path)

    async def close(self) -> None:
        self._server.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        with contextlib.suppress(OSError):
            self.path.unlink()


async def serve(state_dir: str, handler: ControlHandler) -> ControlServer:
    """The daemon's control socket in ``state_dir`` (the ``ControlStarter`` port)."""
    return await ControlServer.start(socket_path(state_dir), handler)


async def request(path: Path, payload: Mapping[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one command to a running daemon and return its answer."""
    async with contextlib.aclosing(converse(path, payload, timeout_s)) as answers:
        async for answer in answers:
            return answer
    raise AssertionError("converse yields an answer or raises")  # pragma: no cover


async def converse(path: Path, payload: Mapping[str, Any], timeout_s: float = 10.0,
                   then_timeout_s: float | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """Send one command to a running daemon; its answer (within ``timeout_s``), then each
    line that follows it (each within ``then_timeout_s``, None: no bound) until the daemon
    closes the connection."""
    try:
        reader, writer = await within(asyncio.open_unix_connection(str(path)), timeout_s)
    except (OSError, TimeoutError) as exc:
        why = "no daemon is listening" if isinstance(exc, FileNotFoundError | ConnectionRefusedError) else str(exc)
        raise ControlError(f"{path}: {why}") from None
    try:
        try:
            writer.write(json.dumps(dict(payload)).encode() + b"\n")
            await writer.drain()
        except OSError as exc:
            raise ControlError(f"{path}: no answer: {exc}") from None
        first = True
        wait_s: float | None = timeout_s
        while True:
            try:
                raw = await within(reader.readline(), wait_s)
            except (OSError, TimeoutError) as exc:
                what = "no answer" if first else "no more from the daemon"
                raise ControlError(f"{path}: {what}: {exc or type(exc).__name__}") from None
            if not raw:
                if first:
                    raise ControlError(f"{path}: no answer: the daemon closed the connection")
                return
            yield _answer(path, raw)
            first, wait_s = False, then_timeout_s
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def _answer(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        answer = json.loads(raw)
    except ValueError:
        raise ControlError(f"{path}: unreadable answer {raw[:80]!r}") from None
    if not isinstance(answer, dict):
        raise ControlError(f"{path}: unreadable answer {raw[:80]!r}")
    return answer
