"""An operator's ``stop --server`` and ``start --server`` end to end, behind the real SGLang
router: two simulated servers ``a`` and ``b`` owned by one real daemon (``[[server]]``, the
router integration on), client load through the router, the commands run as an operator
runs them (the CLI, a subprocess).

1. ``stop --server b`` takes b out of the router, drains and stops it and keeps it stopped
   (a hold in its state file) while the daemon stays up and a is never touched; no request
   through the router fails.
2. The hold outlives the daemon: a new daemon on the same config brings a back and leaves b
   stopped (never launched, ``server_held`` at boot).
3. ``start --server b`` launches it again and returns once it is READY and back in the
   router; no request fails. ``start`` of a server that is not stopped is refused.

The load pauses while the daemon itself restarts: a daemon that stops (SIGTERM) stops its
servers too, so nothing serves behind the router until the new daemon's a is READY.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import router_night
from harness import REPO, DaemonRun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


async def cli(config: Path, *args: str) -> tuple[int, str, str]:
    """``sglang-supervisor ARGS --config CONFIG`` as an operator runs it: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor.cli", *args, "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def state_of(config: Path, server: str) -> dict[str, object]:
    """The server's state file (``[state] dir``/NAME/state.json with several servers)."""
    base = Path(tomllib.loads(config.read_text())["state"]["dir"])
    data: dict[str, object] = json.loads((base / server / "state.json").read_text())
    return data


async def test_a_server_stopped_for_maintenance_stays_stopped_until_started_behind_the_router(
    tmp_path: Path, start_router: Callable[..., str]
) -> None:
    config, router, (url_a, url_b) = await router_night.pair_behind_router(tmp_path, start_router)
    loads: list[router_night.Load] = []

    def load() -> router_night.Load:
        one = router_night.Load(router, 2)
        loads.append(one)
        one.start()
        return one

    try:
        # 1. stop --server b under load: drained, out of the router, held; a untouched
        with DaemonRun(config) as first:
            for name in ("a", "b"):
                await asyncio.to_thread(first.wait_for, "server_ready", 60, server=name)
            await router_night.until_listed(router, [url_a, url_b], "both servers listed")
            during_stop = load()
            await asyncio.sleep(1.0)
            rc, out, err = await cli(config, "stop", "--server", "b")
            assert rc == 0, (out, err)
            assert "stopped and held" in out, out
            # out of the router before it was signalled: the command's return says so already
            assert router_night.listed(router) == [url_a]
            await asyncio.sleep(1.0)  # the load goes on, on a alone
            await during_stop.stop()
            assert during_stop.ok > 0 and not during_stop.failed, (during_stop.ok, during_stop.failed[:3])
            assert first.proc.poll() is None, "the daemon left after a stop --server"
            assert len(first.find("launch", server="a")) == 1
            assert len(first.find("launch", server="b")) == 1
            assert not first.find("crash")
            assert not first.find("restart_scheduled", server="b")
            assert first.find("job_started", server="b", job_type="hold")
            assert first.find("job_done", server="b", job_type="hold")
            held = first.wait_for("server_held", server="b")
            assert not held.get("at_boot"), held
            b = state_of(config, "b")
            assert b["state"] == "STOPPED" and isinstance(b.get("held"), dict), b
            rc, out, err = await cli(config, "status")
            assert rc == 3, (out, err)
            b_lines = [line for line in out.splitlines() if line.startswith("b ")]
            assert len(b_lines) == 1 and "STOPPED" in b_lines[0], out
            assert "held by an operator" in out, out
            assert first.stop() == 0

        # 2. a new daemon on the same config: a comes back, b stays stopped
        with DaemonRun(config) as second:
            await asyncio.to_thread(second.wait_for, "server_ready", 60, server="a")
            at_boot = second.wait_for("server_held", server="b")
            assert at_boot.get("at_boot") is True, at_boot
            await router_night.until_listed(router, [url_a], "a listed again, alone")
            assert not second.find("launch", server="b")
            assert state_of(config, "b")["state"] == "STOPPED"
            rc, out, err = await cli(config, "status")
            assert rc == 3, (out, err)

            during_start = load()
            await asyncio.sleep(1.0)
            # start of a server that is not stopped: refused, one line
            rc, out, err = await cli(config, "start", "--server", "a")
            assert rc == 1, (out, err)
            assert len(err.strip().splitlines()) == 1 and "not stopped" in err, err

            # 3. start --server b: READY at a later launch, back in the router
            rc, out, err = await cli(config, "start", "--server", "b")
            assert rc == 0, (out, err)
            assert "serving again" in out, out
            # READY at a later launch than the one it was held at (launches count per daemon run)
            accepted = re.search(r"start accepted \(b: STOPPED, launch (\d+)\)", out)
            assert accepted, out
            ready = second.wait_for("server_ready", server="b")
            assert int(ready["attempt"]) > int(accepted[1]), (ready, out)
            assert second.find("server_released", server="b")
            assert second.find("job_started", server="b", job_type="start")
            # the command returns once the router lists b again
            assert router_night.listed(router) == sorted([url_a, url_b])
            await asyncio.sleep(1.0)
            await during_start.stop()
            assert during_start.ok > 0 and not during_start.failed, (during_start.ok, during_start.failed[:3])
            assert len(second.find("launch", server="a")) == 1
            assert not second.find("crash")
            assert "held" not in state_of(config, "b") or state_of(config, "b")["held"] is None
            rc, out, err = await cli(config, "status")
            assert rc == 0, (out, err)
            assert second.stop() == 0
    finally:
        for one in loads:
            await one.stop()
