"""Two servers behind the real SGLang router, each owned by a real daemon, under client load
through the router: a killed scheduler and a planned restart of each in turn cost no
request, and the dying server is out of the router before its main process exits.

The night is ``tests/router_night.py``; the servers are the simulator, on SGLang 0.5.23's
crash path with its diagnostics on: after a scheduler dies the main process sleeps 5 s
before it kills its tree, and the router still sends it requests unless someone takes it
out. The same night without the daemon's router integration (the router alone, at its
defaults) is the baseline that bench/bench_router.py measures beside it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import router_night

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_no_request_fails_with_the_daemon_keeping_the_router_true(
    tmp_path: Path, start_router: Callable[..., str], concurrency: int
) -> None:
    night = await router_night.night(tmp_path, start_router, concurrency, integrated=True)
    print(json.dumps(night))
    crash, restart = night["crash"], night["restart"]
    assert crash["ok"] > 0 and crash["failed"] == 0, crash
    assert restart["ok"] > 0 and restart["failed"] == 0, restart
    # out of the router within milliseconds of the death, seconds before SGLang's main exits
    assert crash["removed_s"] < 0.5 < crash["main_exit_s"] - 3.0, crash
