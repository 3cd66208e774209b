"""The daemon's control socket: a Unix socket in the state directory for operator commands.

One JSON object per connection, one JSON answer, then the connection closes. Today's one
command is ``{"cmd": "restart", "reason": "..."}`` (``sglang-supervisor restart``): the
daemon drains, stops and relaunches its server with the current flags. The socket is made
with mode 0600 inside the state directory, so only the daemon's own user can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from supervisor.adapters.ports import ControlError
from supervisor.aio import within

SOCKET_NAME = "control.sock"
MAX_REQUEST = 4096
# sockaddr_un.sun_path is 108 bytes with its terminating NUL.
MAX_PATH = 107


def socket_path(state_dir: str) -> Path:
    return Path(state_dir) / SOCKET_NAME


Handler = Callable[[Mapping[str, Any]], dict[str, Any]]


class ControlServer:
    def __init__(self, server: asyncio.AbstractServer, path: Path) -> None:
        self._server = server
        self.path = path

    @classmethod
    async def start(cls, path: Path, handler: Handler) -> ControlServer:
        if len(os.fsencode(path)) > MAX_PATH:
            raise ControlError(f"{path}: path too long for a Unix socket ({len(os.fsencode(path))} > {MAX_PATH})")

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                raw = await within(reader.readline(), 5.0)
                try:
                    request = json.loads(raw[:MAX_REQUEST] or b"null")
                except ValueError:
                    request = None
                if not isinstance(request, dict):
                    answer: dict[str, Any] = {"ok": False, "error": "expected one JSON object"}
                else:
                    answer = handler(request)
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
            except (TimeoutError, ConnectionError):
                pass
            finally:
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


async def serve(state_dir: str, handler: Handler) -> ControlServer:
    """The daemon's control socket in ``state_dir`` (the ``ControlStarter`` port)."""
    return await ControlServer.start(socket_path(state_dir), handler)


async def request(path: Path, payload: Mapping[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one command to a running daemon and return its answer."""
    try:
        reader, writer = await within(asyncio.open_unix_connection(str(path)), timeout_s)
    except (OSError, TimeoutError) as exc:
        why = "no daemon is listening" if isinstance(exc, FileNotFoundError | ConnectionRefusedError) else str(exc)
        raise ControlError(f"{path}: {why}") from None
    try:
        writer.write(json.dumps(dict(payload)).encode() + b"\n")
        await writer.drain()
        raw = await within(reader.readline(), timeout_s)
    except (OSError, TimeoutError) as exc:
        raise ControlError(f"{path}: no answer: {exc or type(exc).__name__}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    try:
        answer = json.loads(raw)
    except ValueError:
        raise ControlError(f"{path}: unreadable answer {raw[:80]!r}") from None
    if not isinstance(answer, dict):
        raise ControlError(f"{path}: unreadable answer {raw[:80]!r}")
    return answer
