"""Two real SGLang servers on the CPU behind the real ``sglang-router``, both owned by one
real daemon (two ``[[server]]`` entries, ``[router]``): a SIGKILLed scheduler and a rolling
restart (one ``restart`` command) under client load through the router cost no request,
the other server is never touched, and the dying server is out of the router before its
main process exits (SGLang's crash diagnostics on: its main sleeps 5 s first).

The night is ``tests/router_night.py`` (the same as the simulator's in
tests/test_router_daemon.py); bench/bench_router.py measures the router alone beside it.
Two real servers take ~7 GB and both cores: the host-wide real-SGLang lock is held for the
whole night, and every process is reaped even when the test fails.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import REPO
from tests.real import nights
from tests.real.sglang_env import RealSGLang

sys.path.insert(0, str(REPO / "tests"))
import router_night  # noqa: E402

# SGLang's crash path as users run it: py-spy dump switch on (the 5 s sleep before the tree
# is killed), the CUDA coredump wait off (60 s, pointless on the CPU)
DIAGNOSTICS_ON = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
# make test runs 4 clients (the night at 1 costs another ~5 min; the simulator's night runs
# both, and the real soak in make test runs 2): REAL_ROUTER_CONCURRENCY="1,4" by hand
CONCURRENCY = [int(c) for c in os.environ.get("REAL_ROUTER_CONCURRENCY", "4").split(",")]


def two_real_servers(tmp_path: Path, real: RealSGLang) -> list[Path]:
    configs = []
    for name in ("a", "b"):
        tmp = tmp_path / name
        tmp.mkdir()
        configs.append(nights.real_config(
            tmp, real, {"server": {"stop_grace_s": 30.0}, "health": {"failures": 3}}, env=DIAGNOSTICS_ON, name=name,
        ))
    return configs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("concurrency", CONCURRENCY)
async def test_two_real_servers_behind_the_router_lose_no_request(
    tmp_path: Path, real_sglang: RealSGLang, real_lock: None, start_router: Callable[..., str], concurrency: int,
) -> None:
    night = await router_night.night(
        tmp_path, start_router, concurrency, integrated=True,
        configs=two_real_servers(tmp_path, real_sglang), ready_s=240.0, gpus=(),
    )
    print(json.dumps(night))
    crash, restart = night["crash"], night["restart"]
    assert crash["ok"] > 0 and crash["failed"] == 0, crash
    assert restart["ok"] > 0 and restart["failed"] == 0, restart
    # one daemon, two servers: the crash of one never touched the other; one restart
    # command took them down one at a time, each back before the next
    assert crash["other_server_relaunched"] == 0, crash
    assert restart["order"] == ["a: stop", "a: ready", "b: stop", "b: ready"], restart
    assert crash["main_exit_s"] is not None and crash["removed_s"] < crash["main_exit_s"], crash
    assert crash["removed_s"] < 1.0, crash
