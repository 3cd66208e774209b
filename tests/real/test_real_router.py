"""Two real SGLang servers on the CPU behind the real ``sglang-router``, both owned by one
real daemon (two ``[[server]]`` entries, ``[router]``): a SIGKILLed scheduler and a rolling
restart (one ``restart`` command) under client load through the router cost no request,
the other server is never touched, and the dying server is out of the router before its
main process exits (SGLang's crash diagnostics on: its main sleeps 5 s first).

The night of ``tests/router_night.py`` (the simulator's, in tests/test_router_daemon.py,
at 1 and 4 clients; bench/bench_router.py measures the router alone beside it), run on the
real servers as the first two faults of the compressed real night (the session's
``soak_night``: the same two servers, one daemon, the router, 2 clients), so that the tier
starts two real servers once for both (issue 36, item 6).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.real.conftest import SOAK_TIMEOUT_S
from tests.real.soak_real import OPENING


def _opening(night: dict[str, Any]) -> dict[str, dict[str, Any]]:
    faults = [f for f in night["faults"] if f["kind"] != "foreign_server"][: len(OPENING)]
    assert [f["kind"] for f in faults] == list(OPENING), night["faults"]
    return {f["kind"]: f for f in faults}


@pytest.mark.timeout(SOAK_TIMEOUT_S)  # the first test to ask for the night runs it
def test_two_real_servers_behind_the_router_lose_no_request(soak_night: dict[str, Any]) -> None:
    opening = _opening(soak_night)
    crash, restart = opening["sigkill_scheduler"], opening["rolling_restart"]
    print(json.dumps(opening, default=str))
    for f in (crash, restart):
        assert f["error"] == "" and f["to_serving_s"] is not None, f
        assert f["requests_in_window"] > 0 and f["failed"] == 0, f
    # one daemon, two servers: the crash of one never touched the other; one restart
    # command took them down one at a time, each back before the next
    c = crash["detail"]
    assert c["other_server_relaunched"] == 0, crash
    assert restart["detail"]["order"] == ["a: stop", "a: ready", "b: stop", "b: ready"], restart
    assert c["main_exit_s"] is not None and c["removed_s"] < c["main_exit_s"], crash
    assert c["removed_s"] < 1.0, crash
