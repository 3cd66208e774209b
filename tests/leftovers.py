"""The end of a test run: no process the tests started outlives them.

Hooks for pytest, imported into tests/conftest.py: ``pytest_configure`` tags the run
(``RUN_VAR`` in the environment, inherited by every process the tests start; the daemons
pass it on to their servers through ``tests/harness.py``'s configs), and
``pytest_sessionfinish``, after every fixture was torn down, fails the run if any of them is
still alive, names them and kills them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import psutil
import pytest


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


RUN_VAR = "SGLANG_SUPERVISOR_TEST_RUN"
LEFTOVER_WAIT_S = 10.0


def pytest_configure(config: pytest.Config) -> None:
    """Tag this run: every process the tests start inherits ``RUN_VAR`` (the daemons pass it
    on to their servers through ``tests/harness.py``'s configs).

    Under pytest-xdist each worker tags its processes ``<run>.<worker>`` (the run's tag is
    the controller's, inherited): a worker that finishes first judges only what it started,
    never the other worker's live servers, and the controller, last, judges all of them."""
    import uuid

    run_id = os.environ.setdefault(RUN_VAR, uuid.uuid4().hex)
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker:
        os.environ[RUN_VAR] = f"{run_id.split('.')[0]}.{worker}"


def _tagged_by(tag: str | None, run_id: str) -> bool:
    """A process tag of this run: the run's own, or (the controller's view) one of its workers'."""
    return bool(tag) and (tag == run_id or tag.startswith(run_id + "."))


def _run_processes(run_id: str, basetemp: str | None) -> list[psutil.Process]:
    """Live processes this run started: the tests' descendants, processes carrying the
    run's tag, and processes working in the run's temporary directory (a server launched
    by a daemon has its state directory as its cwd). Zombies are not alive."""
    me = os.getpid()
    found: dict[int, psutil.Process] = {p.pid: p for p in _descendants()}
    for p in psutil.process_iter():
        if p.pid == me or p.pid in found:
            continue
        try:
            if _tagged_by(p.environ().get(RUN_VAR), run_id) or (basetemp and (p.cwd() + os.sep).startswith(basetemp + os.sep)):
                found[p.pid] = p
        except psutil.Error:
            continue
    alive = []
    for p in found.values():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(p.pid, os.WNOHANG)  # ours to reap
                continue
            alive.append(p)
        except psutil.Error:
            continue
    return alive


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run if any process it started is still alive at the end (after every
    fixture was torn down): named on the terminal, then killed."""
    run_id = os.environ.get(RUN_VAR, "")
    basetemp = None
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None and getattr(factory, "_basetemp", None) is not None:
        basetemp = str(factory._basetemp)
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    left = _run_processes(run_id, basetemp)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _run_processes(run_id, basetemp)
    described = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"pid {p.pid} {p.name()}: {' '.join(p.cmdline())[:160]}")
            p.kill()
    _record(described, getattr(session.config, "workerinput", {}).get("workerid"))
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = f"{len(described)} process(es) started by the tests outlived them:\n  " + "\n  ".join(described)
    if reporter is not None:
        reporter.write_sep("=", "leftover processes", red=True)
        reporter.write_line(text)
    else:
        print(text)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _record(described: list[str], worker: str | None) -> None:
    """The run's end as one line in ``$CHAOS_RESULTS`` (docs/reliability.md says it), if set.

    Under pytest-xdist every worker and then the controller write one: each counts what it
    found and killed, so their sum is the run's (tests/chaos/report.py adds them up)."""
    path = os.environ.get("CHAOS_RESULTS")
    if not path:
        return
    record = {"kind": "run_end", "leftovers": len(described), "described": described}
    if worker:
        record["worker"] = worker
    with contextlib.suppress(OSError):
        append_line(path, json.dumps(record))


def append_line(path: str, line: str) -> None:
    """One line appended whole even when pytest-xdist workers append to the same file at once:
    one ``write`` on an ``O_APPEND`` descriptor, under an exclusive ``flock``."""
    import fcntl

    data = (line.rstrip("\n") + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)  # releases the lock
