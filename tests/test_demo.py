"""`sglang-supervisor demo` end to end: the seed's night, both scenarios."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import free_port
from harness import REPO

pytestmark = pytest.mark.integration


def _demo(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    test_id = os.environ.get("SGLANG_SUPERVISOR_TEST_ID", "")
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "demo", "--set", f"server.port={free_port()}",
         "--set", "metrics.enabled=false",
         "--set", f'server.env={{SGLANG_SUPERVISOR_TEST_ID="{test_id}"}}', *args],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # the demo keeps its logs in a temp dir
    )


def test_demo_recovers_from_the_093_oom_at_088(tmp_path, no_leftovers):
    """The demo OOMs at 0.93 under the burst, reads cuda_oom_runtime, finishes the load at 0.88."""
    r = _demo(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cuda_oom_runtime" in r.stdout
    assert "mem_fraction_static=0.88" in r.stdout
    assert "FAIL" not in r.stdout
    assert "Traceback" not in r.stderr


def test_demo_preempt_steps_down_before_any_crash(tmp_path, no_leftovers):
    """With the headroom guard on, 0.82 GB after capture means 0.88 before traffic: no crash."""
    r = _demo(tmp_path, "--scenario", "preempt")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "headroom guard" in r.stdout and "CRASH" not in r.stdout
