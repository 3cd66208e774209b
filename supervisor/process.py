"""Owning the server process: its own session, its output, its stop, its leftovers.

- The server starts in a new session (so in its own process group): SGLang does not do
  this itself, and its parts must be signalled as a group.
- stdout and stderr are merged into one pipe read by a task that never lets the child
  stall: the pipe is enlarged, each chunk goes to a size-rotated log file and to a bounded
  in-memory tail kept for the diagnosis; lines are handed to a callback only while one
  is set (startup-fact parsing), so steady serving costs one write per chunk.
- Stopping = SIGTERM to the group, a grace period, SIGKILL to the group and to every
  descendant seen that left it; the main process is always reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from .model import ExitStatus

F_SETPIPE_SZ = 1031  # linux/fcntl.h
PIPE_SIZE = 1 << 20
READ_CHUNK = 1 << 16


class ProcessError(Exception):
    """The server could not be started."""


class RotatingLog:
    """Append-only byte log rotated by size (``server.log``, ``server.log.1``, ...).

    Write errors (disk full, read-only) are counted and reported once through ``on_error``;
    they never propagate: losing log lines must not stop supervision.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int,
        backups: int,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.on_error = on_error
        self.dropped_bytes = 0
        self._failing = False
        self._file = None
        self._size = 0
        self._open()

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - owned for the log's life
            self._size = self._file.tell()
        except OSError as exc:
            self._file = None
            self._fail(f"cannot open {self.path}: {exc.strerror}")

    def _fail(self, why: str) -> None:
        if not self._failing and self.on_error:
            self.on_error(why)
        self._failing = True

    def _rotate(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        try:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            if self.backups > 0:
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
            else:
                self.path.unlink(missing_ok=True)
        except OSError as exc:
            self._fail(f"cannot rotate {self.path}: {exc.strerror}")
        self._open()

    def write(self, data: bytes) -> None:
        if self._file is None:
            self._open()
            if self._file is None:
                self.dropped_bytes += len(data)
                return
        if self._size + len(data) > self.max_bytes and self._size > 0:
            self._rotate()
            if self._file is None:
                self.dropped_bytes += len(data)
                return
        try:
            self._file.write(data)
            self._size += len(data)
            self._failing = False
        except OSError as exc:
            self.dropped_bytes += len(data)
            self._fail(f"cannot write {self.path}: {exc.strerror}")

    def close(self) -> None:
        if self._file:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


class Tail:
    """The last ``limit`` bytes of output (amortised O(1) append)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def append(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > 2 * self.limit:
            del self._buf[: len(self._buf) - self.limit]

    def get(self) -> bytes:
        return bytes(self._buf[-self.limit :])


class ServerProcess:
    """One launched server: its pid/pgid, output pump and lifecycle."""

    def __init__(self, proc: asyncio.subprocess.Process, log: RotatingLog, tail: Tail) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.pgid = proc.pid  # start_new_session=True: the leader of its own group
        self.log = log
        self.tail = tail
        self.on_line: Callable[[str], None] | None = None
        self._partial = b""
        self._known: dict[int, float] = {}  # descendant pid -> create_time
        self._pump = asyncio.create_task(self._read_output(), name=f"server-output-{self.pid}")

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | None,
        log: RotatingLog,
        tail_bytes: int,
    ) -> ServerProcess:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env=dict(env),
                cwd=cwd or None,
                limit=READ_CHUNK * 4,
            )
        except OSError as exc:
            raise ProcessError(f"{argv[0]}: {exc.strerror or exc}") from None
        with contextlib.suppress(Exception):
            transport = proc._transport  # type: ignore[attr-defined]
            pipe = transport.get_pipe_transport(1).get_extra_info("pipe")
            fcntl.fcntl(pipe.fileno(), F_SETPIPE_SZ, PIPE_SIZE)
        return cls(proc, log, Tail(tail_bytes))

    # -- output -----------------------------------------------------------------------------

    async def _read_output(self) -> None:
        stream = self._proc.stdout
        assert stream is not None
        while True:
            try:
                data = await stream.read(READ_CHUNK)
            except (OSError, ValueError):
                break
            if not data:
                break
            self.log.write(data)
            self.tail.append(data)
            if self.on_line is not None:
                self._split_lines(data)
        if self._partial and self.on_line is not None:
            self._deliver(self._partial)
        self._partial = b""

    def _split_lines(self, data: bytes) -> None:
        chunk = self._partial + data
        lines = chunk.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > READ_CHUNK * 4:  # a runaway line: keep it bounded
            self._partial = self._partial[-READ_CHUNK:]
        for line in lines:
            self._deliver(line)

    def _deliver(self, line: bytes) -> None:
        callback = self.on_line
        if callback is not None:
            callback(line.decode("utf-8", errors="replace").rstrip("\r"))

    async def drain_output(self, timeout_s: float) -> None:
        """Wait (bounded) for the output pump to reach EOF: the last lines hold the cause."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._pump), timeout_s)

    # -- lifecycle --------------------------------------------------------------------------

    def remember_descendants(self) -> list[int]:
        """Note every current descendant, so one that leaves the group is still found."""
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        for k in kids:
            with contextlib.suppress(psutil.Error):
                self._known[k.pid] = k.create_time()
        return [self.pid, *self._known]

    def tree_pids(self) -> list[int]:
        return [self.pid, *self._known]

    async def wait(self) -> ExitStatus:
        return ExitStatus.from_returncode(await self._proc.wait())

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def kill_leftovers(self) -> list[int]:
        """SIGKILL the group and every remembered descendant still alive. Returns pids hit."""
        self.signal_group(signal.SIGKILL)
        hit = []
        for pid, created in list(self._known.items()):
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 1.0:
                    p.kill()
                    hit.append(pid)
            except psutil.Error:
                pass
            self._known.pop(pid, None)
        return hit

    async def stop(self, grace_s: float) -> ExitStatus:
        """SIGTERM the group, wait ``grace_s``, then SIGKILL everything; always reaps."""
        self.remember_descendants()
        if self._proc.returncode is None and grace_s > 0:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._proc.wait(), grace_s)
        self.kill_leftovers()
        status = await self.wait()
        await self.drain_output(0.5)
        return status

    async def close(self) -> None:
        """Drop the output pump (after the process is gone) and close the log."""
        await self.drain_output(0.5)
        if not self._pump.done():
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        self.log.close()


def server_env(pass_env: Sequence[str], extra: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Only the variables the config names: ``pass_env`` from our environment, plus ``env``."""
    env = {k: environ[k] for k in pass_env if k in environ}
    env.update(extra)
    return env
