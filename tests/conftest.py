"""Shared fixtures: free ports, required binaries, and the no-leftover-process check."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator

import psutil
import pytest

IN_CI = bool(os.environ.get("CI"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def ours(title_parts: tuple[str, ...] = ("supervisor.simulator", "sglang::")) -> list[psutil.Process]:
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


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Fails the test if it leaves a child, a zombie, or a simulator/SGLang process behind."""
    before = {p.pid for p in ours()}
    yield
    def clean() -> bool:
        kids = [p for p in _descendants() if p.is_running()]
        stray = [p for p in ours() if p.pid not in before and p.is_running()]
        return not kids and not stray

    try:
        wait_until(clean, timeout=10.0, what="no leftover processes")
    except AssertionError:
        kids = [(p.pid, p.status(), p.cmdline()) for p in _descendants() if p.is_running()]
        stray = [(p.pid, p.status(), p.cmdline()) for p in ours() if p.pid not in before]
        for p in [*_descendants(), *[q for q in ours() if q.pid not in before]]:
            try:
                p.kill()
            except psutil.Error:
                pass
        pytest.fail(f"leftover processes: children={kids} strays={stray}")
