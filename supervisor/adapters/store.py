"""The state directory: learned state, the live server's process group, a lock.

- ``state.json`` is written atomically (temp file, rename): once ``save`` returns, the new
  state is what any reader or a restarted daemon sees, even if this daemon is killed the next
  instant. Its fsync (file, then directory), against a power loss, runs on one worker thread
  right after, off the crash path: it cost 0.4-2.3 ms before each ``state_changed`` of a
  crash, more than the rest of noticing it (issue 36). A flush that fails is raised by the
  next ``save``, once that one's state is written. A corrupt file is moved aside with a
  warning and the daemon starts from the config, never crashes.
- ``daemon.lock`` is held (flock) while a daemon runs on this state directory, so two
  daemons can never drive two servers onto the same GPUs.
- Write failures (read-only or full disk) raise ``StoreError``; the daemon logs them once
  and keeps supervising with the state in memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from supervisor.adapters.ports import StoreError

STATE_FILE = "state.json"
LOCK_FILE = "daemon.lock"


class StateStore:
    def __init__(self, directory: str | os.PathLike[str], *, inherited_lock: int | None = None) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STATE_FILE
        self._lock_fd: int | None = None
        self._inherited_lock = inherited_lock  # the lock a re-exec kept open (``adapters.reexec``)
        self._flusher: ThreadPoolExecutor | None = None  # one thread: the fsyncs, in order
        self._flush_error: str | None = None

    @property
    def lock_fd(self) -> int | None:
        return self._lock_fd

    # -- lock -------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the daemon lock; StoreError names the holder when another daemon runs. After
        a re-exec the lock kept open across it is still ours: it is held on, never let go."""
        inherited, self._inherited_lock = self._inherited_lock, None
        if inherited is not None:
            try:
                fcntl.flock(inherited, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours: the same open file
                os.set_inheritable(inherited, False)
            except OSError:
                with contextlib.suppress(OSError):
                    os.close(inherited)
            else:
                self._lock_fd = inherited
                return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"{self.dir}: cannot open the lock file: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreError(
                f"{self.dir}: another sglang-supervisor (pid {holder}) runs on this state "
                "directory; refusing to start a second server on the same GPUs"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass  # a full disk must not stop us from holding the lock
        self._lock_fd = fd

    def release(self) -> None:
        self.flushed()  # the last state on the disk before another daemon may take it
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def locked_by_other(self) -> bool:
        """True when a running daemon holds the lock (for ``status``)."""
        try:
            fd = os.open(self.dir / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        else:
            return False
        finally:
            os.close(fd)

    # -- state ------------------------------------------------------------------------------

    def load(self, *, move_aside: bool = True) -> tuple[dict[str, Any] | None, str | None]:
        """(state, warning). A missing file is (None, None); a corrupt one is moved aside
        (only by the daemon: readers such as ``status`` pass ``move_aside=False``)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            return None, f"{self.path}: cannot read ({exc.strerror}); starting from the config"
        try:
            data = _state_object(raw)
        except ValueError as exc:
            if not move_aside:
                return None, f"{self.path}: corrupt ({exc})"
            aside = self.path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}")  # wall-clock timestamp in the name, for people
            try:
                self.path.replace(aside)
                where = f"moved to {aside}"
            except OSError as move_exc:
                where = f"could not move it aside: {move_exc.strerror}"
            return None, f"{self.path}: corrupt ({exc}); {where}; starting from the config"
        return data, None

    def save(self, data: dict[str, Any]) -> None:
        payload = json.dumps({"version": 1, **data}, indent=1, sort_keys=True).encode()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".state-", suffix=".tmp")
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot write: {exc.strerror}") from None
        try:
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(payload)
            Path(tmp).replace(self.path)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                Path(tmp).unlink()
            raise StoreError(f"{self.path}: cannot write: {exc.strerror}") from None
        error, self._flush_error = self._flush_error, None  # an earlier flush's, read before this one's
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-fsync")
        self._flusher.submit(self._flush, fd)
        if error is not None:  # this state is written; the disk lost an earlier one
            raise StoreError(f"{self.path}: cannot write: {error}")

    def _flush(self, fd: int) -> None:
        """On the flusher's thread: the file written (``fd``, then closed) and its rename, to
        the disk."""
        try:
            os.fsync(fd)
            dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            self._flush_error = exc.strerror or type(exc).__name__
        finally:
            os.close(fd)

    def flushed(self) -> None:
        """Until every save so far is on the disk (a clean exit, a re-exec, a test)."""
        if self._flusher is not None:
            self._flusher.submit(lambda: None).result()


def _state_object(raw: bytes) -> dict[str, Any]:
    """The state file's JSON object; ValueError when it is not a version-1 state object."""
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("version") != 1:
        raise ValueError("not a version-1 state object")
    return data
