"""A server's output as the daemon keeps it: the size-rotated log file (``RotatingLog``) and
the bounded in-memory tail the diagnosis reads (``Tail``). Shared by the process adapter
(``adapters.process``, which writes them) and the CLI (``logs``)."""

from __future__ import annotations

import collections
import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path


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
        self._file: io.FileIO | None = None
        self._size = 0
        self._open()

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab", buffering=0)  # noqa: SIM115 - owned for the log's life
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
                    src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
            if self.backups > 0:
                self.path.replace(self.path.with_name(f"{self.path.name}.1"))
            else:
                self.path.unlink(missing_ok=True)
        except OSError as exc:
            self._fail(f"cannot rotate {self.path}: {exc.strerror}")
        self._open()

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``, rotating at ``max_bytes`` (a big chunk is split at a newline)."""
        view = memoryview(data)
        rotated = False
        while view:
            if self._file is None:
                self._open()
                if self._file is None:
                    self.dropped_bytes += len(view)
                    return
            room = self.max_bytes - self._size
            if room <= 0 or (len(view) > room and self._size > 0 and len(view) <= self.max_bytes):
                if rotated and self._size > 0:  # rotation failed (reported): keep appending
                    room = len(view)
                else:
                    self._rotate()
                    rotated = self._size > 0
                    continue
            piece = view[:room]
            if len(view) > room:  # a chunk bigger than a whole file: cut it at a line end
                cut = bytes(piece).rfind(b"\n") + 1
                piece = view[: cut or room]
            try:
                self._file.write(piece)
                self._size += len(piece)
                self._failing = False
            except OSError as exc:
                self.dropped_bytes += len(view)
                self._fail(f"cannot write {self.path}: {exc.strerror}")
                return
            view = view[len(piece):]

    def close(self) -> None:
        if self._file:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


class Tail:
    """The last ``limit`` bytes of output, kept in fixed blocks (64 KiB, or the limit if
    smaller), each allocated once at its full size: reads are copied into the newest block
    and the oldest block is dropped whole. Memory stays at ``limit`` plus one block whatever
    the reads' sizes (a line per read is common), and the allocator sees a few equal buffers,
    never one small object per read nor a buffer regrown read after read."""

    BLOCK = 64 * 1024

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.block = min(self.BLOCK, limit)
        self._blocks: collections.deque[bytearray] = collections.deque()
        self._fill = self.block  # bytes used in the newest block (full: the next read starts one)
        self._size = 0
        self.total = 0  # bytes appended since the launch: where a moment sits in the output

    def append(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        self.total += len(view)
        if len(view) >= self.limit:
            self._blocks.clear()
            self._fill, self._size = self.block, 0
            view = view[-self.limit :]
        while view:
            if self._fill == self.block:
                self._blocks.append(bytearray(self.block))
                self._fill = 0
            piece = view[: self.block - self._fill]
            self._blocks[-1][self._fill : self._fill + len(piece)] = piece
            self._fill += len(piece)
            self._size += len(piece)
            view = view[len(piece):]
        while len(self._blocks) > 1 and self._size - self.block >= self.limit:
            self._blocks.popleft()
            self._size -= self.block

    def get(self) -> bytes:
        if not self._blocks:
            return b""
        *full, last = self._blocks
        return b"".join([*full, memoryview(last)[: self._fill]])[-self.limit :]
