"""A real component a test runs (mosquitto, etcd): started and waited for, stopped and reaped.

``LocalService`` owns one process: ``start`` launches ``argv`` and waits until ``ready()``
(failing with the service's log if it exits or is slow), ``stop`` sends SIGTERM, then
SIGKILL after ``timeout``, and always reaps. ``stop`` then ``start`` plays an outage: the
subclass keeps its ports and data, so the service comes back as a restarted one does.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path


class LocalService:
    """One process; subclasses set ``what`` and ``argv`` and say when it is ``ready``."""

    what = "the service"
    log_chars = 4000  # the end of the log that goes into a failure message

    def __init__(self, argv: list[str], log_file: Path, *, output_to_log: bool, own_session: bool = False) -> None:
        self.argv = argv
        self.log_file = log_file
        self._output_to_log = output_to_log  # else the service writes log_file itself
        self._own_session = own_session
        self._proc: subprocess.Popen[bytes] | None = None

    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-self.log_chars:]
        except OSError:
            return ""

    def start(self, timeout: float = 30.0) -> None:
        """Start it and wait until ``ready()``; on failure it is stopped and the test fails."""
        if self.running:
            return
        with self.log_file.open("ab") as out:
            sink = out if self._output_to_log else subprocess.DEVNULL
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
                                          start_new_session=self._own_session)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self._proc.poll() is not None:
                code, self._proc = self._proc.returncode, None
                raise AssertionError(f"{self.what} exited with {code}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{self.what} was not ready within {timeout} s:\n{self.log()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaped."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    async def astart(self) -> None:
        """``start`` without blocking the event loop the code under test runs on."""
        await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        """``stop`` without blocking the event loop the code under test runs on."""
        await asyncio.to_thread(self.stop)
