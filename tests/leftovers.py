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
    on to their servers through ``tests/harness.py``'s configs)."""
    import uuid

    os.environ.setdefault(RUN_VAR, uuid.uuid4().hex)


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
            if p.environ().get(RUN_VAR) == run_id or (basetemp and (p.cwd() + os.sep).startswith(basetemp + os.sep)):
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
    _record(described)
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


def _record(described: list[str]) -> None:
    """The run's end as one line in ``$CHAOS_RESULTS`` (docs/reliability.md says it), if set."""
    path = os.environ.get("CHAOS_RESULTS")
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "run_end", "leftovers": len(described), "described": described}) + "\n")
