"""The end-of-run check (tests/conftest.py): a run whose tests leave a process alive fails.

A nested pytest run, with this project's conftest hooks, over one test that starts a
process and walks away: the run must fail, name the process, and kill it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


def _nested_run(tmp_path: Path, test_body: str, *args: str, conftest_extra: str = "") -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from tests.leftovers import pytest_configure, pytest_sessionfinish  # noqa: F401 - the hooks under test
    """) + textwrap.dedent(conftest_extra))
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(test_body))
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_SUPERVISOR_TEST_RUN"}  # a run of its own
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def test_a_process_left_behind_fails_the_run_and_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    r = _nested_run(tmp_path, f"""
        import subprocess
        def test_walks_away():
            p = subprocess.Popen(["sleep", "600"], start_new_session=True)
            open({str(pid_file)!r}, "w").write(str(p.pid))
    """)
    pid = int(pid_file.read_text())
    assert r.returncode == 1, r.stdout + r.stderr
    assert "outlived" in r.stdout and f"pid {pid} sleep" in r.stdout, r.stdout
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the leftover was not killed"
        time.sleep(0.1)


def test_a_run_that_reaps_what_it_started_passes(tmp_path: Path) -> None:
    r = _nested_run(tmp_path, """
        import subprocess
        def test_cleans_up():
            p = subprocess.Popen(["sleep", "600"])
            p.kill()
            p.wait()
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outlived" not in r.stdout


def test_a_worker_that_finishes_first_leaves_the_other_workers_processes_alone(tmp_path: Path) -> None:
    """Under pytest-xdist (scripts/run-tiers runs -n 2) each worker judges its own processes:
    the worker that runs out of tests first must not take the other one's live child for a
    leftover and kill it. The slow test waits until the other worker's session is over (its
    end-of-run check done: ``pytest_unconfigure`` comes after every ``pytest_sessionfinish``),
    then its child must still be alive; it reaps it itself."""
    ended = tmp_path / "ended"
    ended.mkdir()
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    r = _nested_run(tmp_path, f"""
        import os, subprocess, time
        def test_slow_with_a_child():
            child = subprocess.Popen(["sleep", "600"])
            try:
                deadline = time.monotonic() + 60
                while not any(p.name != os.environ["PYTEST_XDIST_WORKER"] for p in os.scandir({str(ended)!r})):
                    assert time.monotonic() < deadline, "the other worker's session never ended"
                    time.sleep(0.1)
                assert child.poll() is None, "the other worker's end-of-run check killed this test's child"
            finally:
                child.kill()
                child.wait()
    """, "-n", "2", "--dist", "loadfile", conftest_extra=f"""
        def pytest_unconfigure(config):
            worker = getattr(config, "workerinput", {{}}).get("workerid")
            if worker:
                open(os.path.join({str(ended)!r}, worker), "w").close()
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout and "outlived" not in r.stdout, r.stdout
