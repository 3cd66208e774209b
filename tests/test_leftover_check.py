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


def _nested_run(tmp_path: Path, test_body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from tests.leftovers import pytest_configure, pytest_sessionfinish  # noqa: F401 - the hooks under test
    """))
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(test_body))
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_SUPERVISOR_TEST_RUN"}  # a run of its own
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
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
