"""The real-SGLang tier: fixtures for tests that launch an actual SGLang server on the CPU.

Every test here is marked ``real`` and gets a 300 s timeout. A missing setup is a failure,
never a skip: ``make e2e`` runs ``make real-sglang`` first.
"""

from __future__ import annotations

import fcntl
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real import launches
from tests.real.sglang_env import RealSGLang, RealSGLangMissing, load

LOCK_PATH = "/tmp/real-sglang.lock"  # shared with other users of the host: one real server at a time
REAL_TIMEOUT_S = 300
_HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real: launches a real SGLang server on the CPU (make e2e)")
    config.addinivalue_line("markers", "soak: the real night, compressed (make soak-real); not in make test yet")
    launches.COUNTER.start()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.real)
            if item.get_closest_marker("timeout") is None:  # a test may need longer (the conformance night)
                item.add_marker(pytest.mark.timeout(REAL_TIMEOUT_S))
    # the launch budget is judged last, once every launch of the run was seen
    items.sort(key=lambda item: Path(str(item.path)).name == "test_launch_budget.py")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    launches.COUNTER.stop()
    terminalreporter.write_line(launches.COUNTER.summary())


@pytest.fixture(scope="session")
def real_sglang() -> RealSGLang:
    try:
        return load()
    except RealSGLangMissing as e:
        problem = str(e)
    pytest.fail(problem, pytrace=False)  # outside the except: one message, no chained traceback


@pytest.fixture
def real_lock() -> Iterator[None]:
    """Holds the host-wide real-SGLang lock (the same one `flock /tmp/real-sglang.lock` takes)."""
    with open(LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def night(real_sglang: RealSGLang, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The scripted night (tests/real/nights.py) on one daemon owning the real server, run
    once and read by several tests."""
    import time

    from tests.real import nights

    tmp = tmp_path_factory.mktemp("real-night")
    with open(LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.monotonic()
        result = nights.drive(nights.real_config(tmp, real_sglang))
        result.timings["night_s"] = time.monotonic() - t0
    yield result


SOAK_MINUTES = float(os.environ.get("SOAK_MINUTES", "5"))
# the night's own length, its setup, the last fault's recovery and its teardown
SOAK_TIMEOUT_S = int(SOAK_MINUTES * 60) + 1200


@pytest.fixture(scope="session")
def soak_night(real_sglang: RealSGLang, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The real night, compressed (tests/real/soak_real.py; ``SOAK_MINUTES``, default 5;
    ``SOAK_SEED`` picks it, printed either way), run once under the host lock and read by
    ``test_soak_real.py`` and ``test_real_router.py``: it opens with the router's two faults
    (``soak_real.OPENING``), then draws from the shuffled deck."""
    from tests.real import soak_real

    seed = int(os.environ["SOAK_SEED"]) if os.environ.get("SOAK_SEED") else random.SystemRandom().randrange(1, 10**6)
    print(f"SOAK_SEED={seed} SOAK_MINUTES={SOAK_MINUTES:g}")
    tmp = tmp_path_factory.mktemp("real-soak")
    with open(LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            results = soak_real.run_night(SOAK_MINUTES, seed, tmp, opening=soak_real.OPENING)
        except soak_real.SoakSetupError as e:
            problem = str(e)
        else:
            return results
    pytest.fail(problem, pytrace=False)
