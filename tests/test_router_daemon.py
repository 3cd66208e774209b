"""Two servers behind the real SGLang router, both owned by one real daemon (``[[server]]``),
under client load through the router: a killed scheduler and a rolling restart (one
``restart`` command, the servers one at a time) cost no request, the dying server is out
of the router before its main process exits, and the other server is never touched.

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
    # one daemon, two servers: the crash of one never touched the other; one restart
    # command took them down one at a time, each back before the next
    assert crash["other_server_relaunched"] == 0, crash
    assert restart["order"] == ["a: stop", "a: ready", "b: stop", "b: ready"], restart
    # out of the router within milliseconds of the death, seconds before SGLang's main exits
    assert crash["removed_s"] < 0.5 < crash["main_exit_s"] - 3.0, crash
