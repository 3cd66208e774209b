"""The real SGLang router (``sglang-router`` from the [test] extra) for the tests: started in
its own session on free ports, always reaped. Without the package a test fails naming it;
it never skips."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import free_port, wait_until

START_S = 30.0  # the router listens within ~0.5 s; the simulator within a few (2 shared cores)


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status ``url`` answers with, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


class Proc:
    """A process in its own session, its output in a file; ``stop`` kills the group and reaps."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_http(self, url: str, what: str) -> None:
        """Until ``url`` answers 200; fails with the output if the process dies or is slow."""
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{what} exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            return http_status(url) == 200
        try:
            wait_until(up, timeout=START_S, interval=0.05, what=f"{what} to answer {url}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.text()[-3000:]}") from None

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def router_argv(port: int, *extra: str) -> list[str]:
    if importlib.util.find_spec("sglang_router") is None:
        pytest.fail("sglang-router is not installed; it comes with the [test] extra (pip install -e '.[test]'): "
                    "tests/test_router.py runs the real router")
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            # the metrics listener defaults to 0.0.0.0:29000: two routers would collide
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "info", *extra]


@contextlib.contextmanager
def routers(logs: Path) -> Iterator[Callable[..., str]]:
    """``start(*extra_flags)`` starts a real router and returns its base URL; every router
    started is killed and reaped on the way out (its log in ``logs``)."""
    procs: list[Proc] = []

    def start(*extra: str) -> str:
        port = free_port()
        proc = Proc(router_argv(port, *extra), logs / f"router-{port}.log")
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(url + "/health", "the router")
        return url

    try:
        yield start
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def start_router(tmp_path: Path, no_leftovers: str) -> Iterator[Callable[..., str]]:
    """Starts real routers (extra flags as arguments); returns each one's base URL."""
    with routers(tmp_path) as start:
        yield start
