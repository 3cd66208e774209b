"""The real tier's launches stay within their budget (``tests/real/launches.py``); this file is
moved to the end of the tier by its conftest, so that the budget sees every launch of the run."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.real.launches import BUDGET, COUNTER


def test_the_counter_sees_a_launch_of_this_run() -> None:
    """A stand-in whose command line is a launch (it only sleeps) is counted once, for this
    test; then it is taken off again, since it launched nothing real."""
    this = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    before = COUNTER.by_test[this]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)", "-m", "sglang.launch_server"])
    try:
        COUNTER.scan()
        COUNTER.scan()  # seen once, however often it is looked at
        assert COUNTER.by_test[this] == before + 1
    finally:
        child.kill()
        child.wait()
        COUNTER.by_test[this] -= 1


def test_the_real_tier_launches_no_more_servers_than_its_budget() -> None:
    COUNTER.scan()
    assert COUNTER.run_id, "the run has no tag: launches cannot be told apart from other users' servers"
    print(COUNTER.summary())
    assert COUNTER.total <= BUDGET, (
        f"{COUNTER.summary()}: the real tier launched more real servers than its budget; share a server "
        "(the night fixture, the soak) or raise BUDGET in tests/real/launches.py on purpose, saying what it buys")
