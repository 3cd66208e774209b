"""A process's start since boot: what tells it from a later process with its pid, whatever
the wall clock does (``supervisor.adapters.procstart``)."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from conftest import wait_until

from supervisor.adapters.procstart import boot_id, running, started, still


def test_a_process_reads_the_same_start_after_a_clock_step_that_moves_its_create_time(clock_step) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start, created = started(child.pid), psutil.Process(child.pid).create_time()
        clock_step(+5.0)
        assert psutil.Process(child.pid).create_time() == pytest.approx(created + 5.0)  # what a step does
        assert started(child.pid) == start
        assert still(child.pid, start) and running(child.pid, start)
        assert not still(child.pid, start + 1)  # a later process with this pid
    finally:
        child.kill()
        child.wait()


def test_a_zombie_is_still_its_process_but_not_running() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = started(child.pid)
    wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, what="the child ends")
    try:  # ended, not reaped yet: a zombie
        assert still(child.pid, start) and not running(child.pid, start)
    finally:
        child.wait()
    assert not still(child.pid, start) and not running(child.pid, start)
    with pytest.raises(psutil.NoSuchProcess):
        started(child.pid)


def test_a_title_with_spaces_and_parentheses_does_not_shift_the_fields() -> None:
    code = "import setproctitle, sys, time; setproctitle.setproctitle('x) (y z) 1 2'); print(1, flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline()
        # psutil parses the same field; without a clock step the two agree to the tick
        assert started(child.pid) / psutil._pslinux.CLOCK_TICKS + psutil.boot_time() == pytest.approx(
            psutil.Process(child.pid).create_time(), abs=0.02)
    finally:
        child.kill()
        child.wait()


def test_the_boot_id_is_the_kernels_and_stays() -> None:
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot_id() == f.read().strip() != ""
