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


async def test_a_killed_daemons_servers_are_replaced_one_at_a_time_behind_the_router(
    tmp_path: Path, start_router: Callable[..., str]
) -> None:
    """The daemon is SIGKILLed and started again (not under systemd, whose KillMode=mixed
    takes the servers with it: docs/systemd.md). Its servers still serve behind the router;
    the new daemon replaces them one at a time, each only while the other serves, and no
    client request fails. Before, the new daemon's first reconcile took both out of the
    router and each unit killed its old server at once: every request failed until a
    relaunch was READY."""
    import asyncio

    from conftest import wait_until
    from harness import DaemonRun

    merged, router_url, urls = await router_night.pair_behind_router(tmp_path, start_router)
    urls = sorted(urls)
    first = DaemonRun(merged)
    try:
        for name in ("a", "b"):
            await asyncio.to_thread(first.wait_for, "server_ready", 60, server=name)
        await asyncio.to_thread(wait_until, lambda: router_night.listed(router_url) == urls, 30, 0.05, "both listed")
        old = {name: int(first.wait_for("launch", server=name)["pid"]) for name in ("a", "b")}
        load = router_night.Load(router_url, 2)
        load.start()
        await asyncio.sleep(1.0)
        first.kill()
    finally:
        first.kill()
    with DaemonRun(merged) as second:
        for name in ("a", "b"):
            await asyncio.to_thread(second.wait_for, "server_ready", 90, server=name)
        await asyncio.to_thread(wait_until, lambda: router_night.listed(router_url) == urls, 30, 0.05, "listed again")
        await asyncio.sleep(1.0)
        await load.stop()
        assert load.ok > 0 and not load.failed, (load.ok, load.failed[:3])
        # each old server waited for its turn, then was replaced; the second only once the
        # first one's replacement was READY
        steps = [(e["server"], e.get("step") or "ready") for e in second.events()
                 if e.get("event") in ("inherited_server", "server_ready")]
        first_out = next(s for s, step in steps if step == "replacing")
        other = "b" if first_out == "a" else "a"
        assert steps.index((other, "replacing")) > steps.index((first_out, "ready")), steps
        assert {s for s, step in steps if step == "waiting"} == {"a", "b"}, steps
        killed = {pid for e in second.find("orphans_killed") for pid in e["pids"]}
        assert set(old.values()) <= killed, (old, killed)
        assert second.stop() == 0
