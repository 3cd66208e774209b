"""Shared fixtures: free ports, required binaries, the no-leftover-process check, a clock step."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

IN_CI = bool(os.environ.get("CI"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_for_later(low: int = 10000, high: int = 21999, attempts: int = 64) -> int:
    """A free port below the kernel's ephemeral range (32768 up by default) and below
    SGLang's own pick for its NCCL port (22000-29999), for a server that binds it only after
    a long start (a real SGLang: after its model load). A port from ``free_port`` is
    ephemeral: any ``bind(0)`` or ``connect()`` on the host may be handed it in between (a
    clean run saw a second real server's port taken by the first one's scheduler while the
    second loaded; its HTTP server then could not bind). SGLang keeps its own late port out
    of that range for the same reason."""
    import random

    for port in random.sample(range(low, high + 1), attempts):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {low}-{high} after {attempts} tries")


def require_binary(name: str, *extra_dirs: str) -> str:
    """Path of a binary the test needs: a failure in CI, a skip elsewhere."""
    path = shutil.which(name) or next(
        (os.path.join(d, name) for d in ("/usr/sbin", "/usr/bin", *extra_dirs) if os.path.exists(os.path.join(d, name))),
        None,
    )
    if path:
        return path
    msg = f"{name} is not installed (.ci/run installs it with apt-get)"
    if IN_CI:
        pytest.fail(msg)
    pytest.skip(f"{msg}; not in CI")
    raise AssertionError("unreachable")


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def ours(title_parts: tuple[str, ...] = ("supervisor.sim.simulator", "sglang::")) -> list[psutil.Process]:
    """Every live process on the machine that looks like our simulator or an SGLang part."""
    found = []
    for p in psutil.process_iter(["cmdline", "name", "status"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
            if p.pid != os.getpid() and any(t in text for t in title_parts):
                found.append(p)
        except psutil.Error:
            continue
    return found


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


TEST_ID_VAR = "SGLANG_SUPERVISOR_TEST_ID"


def _tagged(test_id: str) -> list[psutil.Process]:
    """Live processes carrying this test's id in their environment (its servers included)."""
    found = []
    for p in ours():
        try:
            if p.environ().get(TEST_ID_VAR) == test_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


@contextlib.contextmanager
def leftovers_guard() -> Iterator[str]:
    """Fails the test if it leaves a child, a zombie, or a simulator/SGLang process behind.

    The test's processes are told apart from other people's by an id in their environment
    (``SGLANG_SUPERVISOR_TEST_ID``): children inherit it, and ``tests/harness.py`` passes it
    to the servers the daemon launches. Yields the id. ``no_leftovers`` is it for one test; a
    fixture shared by several tests (the real group) holds it for as long as it lives.
    """
    import uuid

    test_id = uuid.uuid4().hex
    old = os.environ.get(TEST_ID_VAR)
    os.environ[TEST_ID_VAR] = test_id
    try:
        yield test_id
    finally:
        if old is None:
            os.environ.pop(TEST_ID_VAR, None)
        else:
            os.environ[TEST_ID_VAR] = old

    def clean() -> bool:
        kids = [p for p in _descendants() if p.is_running()]
        return not kids and not _tagged(test_id)

    try:
        wait_until(clean, timeout=10.0, what="no leftover processes")
    except AssertionError:
        left = {p.pid: p for p in [*_descendants(), *_tagged(test_id)]}
        described = []
        for p in left.values():
            try:
                described.append((p.pid, p.status(), " ".join(p.cmdline())[:120]))
                p.kill()
            except psutil.Error:
                pass
        pytest.fail(f"leftover processes: {described}")


@pytest.fixture
def no_leftovers() -> Iterator[str]:
    """:func:`leftovers_guard` around one test."""
    with leftovers_guard() as test_id:
        yield test_id


from tests.leftovers import pytest_configure, pytest_sessionfinish  # noqa: E402,F401 - the end-of-run check
from tests.routerlib import start_router  # noqa: E402,F401 - the real SGLang router, a fixture


@pytest.fixture
def clock_step(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """``step(s)``: the wall clock stepped by ``s`` seconds, as psutil sees it: the boot's
    wall-clock time (``btime``, read at every ``create_time()``) moves by ``s``, and with it
    the create time of every process asked afresh. What NTP's first sync or a VM resumed from
    a snapshot does; the real clock is not touched."""
    import psutil._pslinux as pslinux

    real = pslinux.boot_time

    def step(s: float) -> None:
        monkeypatch.setattr(pslinux, "boot_time", lambda: real() + s)

    return step
