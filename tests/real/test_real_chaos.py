"""The chaos matrix's faults that mean something to a real server, on the real SGLang 0.5.23
(CPU, the bf16 tiny model): one trial each in ``make test``, ``CHAOS_TRIALS=N`` by hand.

The simulator's matrix (tests/chaos/test_chaos_matrix.py) promises, per fault, what the
daemon does; here the same promise is checked against the real server. The faults the
rest of the real tier or the real soak already run (a SIGKILLed part, a hang, a host OOM,
a KV-pool failure, a foreign server on the port, the broker away, the state directory
unwritable, the daemon SIGKILLed while serving) are not repeated; those that only make
sense on the simulator are listed, with why, in docs/reliability.md.

One daemon takes its server through a segfault, an exit 0 nobody asked for, a daemon
SIGKILLed mid-stop and one SIGKILLed mid-startup, each time to READY again; a second, with
a start-up timeout shorter than the model's load, shows the slow start.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.harness import DaemonRun, watch_exit
from tests.real import nights

TRIALS = int(os.environ.get("CHAOS_TRIALS", "1"))
READY_S = 300.0


def _state(cfg: Path) -> dict:
    return json.loads((Path(nights.config_of(cfg)["state"]["dir"]) / "state.json").read_text())


def _old_server_stopped_first(d: DaemonRun, old: int, exited: dict[str, float]) -> None:
    """A new daemon's launch comes after the last one's server is gone (stopped by it,
    ``orphans_killed``, or ended by itself: told to stop before the daemon was killed, or
    dead of its lost log pipe while it loaded), then it serves."""
    launch = d.wait_for("launch", timeout=120)
    deadline = time.monotonic() + 30
    while "at" not in exited and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "at" in exited and exited["at"] <= float(launch["mono"]) + 0.05, (exited, launch)
    killed = d.find("orphans_killed")
    assert all(float(k["mono"]) < float(launch["mono"]) for k in killed), killed
    d.wait_for("server_ready", timeout=READY_S)
    assert not d.find("state_corrupt") and not d.find("state_unreadable")


@pytest.mark.timeout(int(1500 * TRIALS))
@pytest.mark.parametrize("trial", range(TRIALS))
def test_the_chaos_matrixs_server_faults_on_the_real_server(real_sglang, tmp_path, real_lock, no_leftovers,
                                                            trial: int) -> None:
    cfg = nights.real_config(tmp_path, real_sglang, {"server": {"stop_grace_s": 30.0}}, name="chaos")
    d = DaemonRun(cfg)
    try:
        d.wait_for("server_ready", timeout=READY_S)

        # segfault: a crash (SIGSEGV in a part); a plain restart; serving
        main = int(d.wait_for("launch", attempt=1)["pid"])
        os.kill(nights.part(main).pid, signal.SIGSEGV)
        crash = d.wait_for("crash", timeout=90)
        assert (crash["remedy"], (crash["part_died"] or "").split(" ")[0]) == ("restart", "sglang::scheduler"), crash
        d.wait_for("server_ready", count=2, timeout=READY_S)

        # an exit nobody asked for: SGLang's main process told to stop from outside (not by
        # the daemon); a crash, a plain restart; serving
        main = int(d.wait_for("launch", attempt=2)["pid"])
        os.kill(main, signal.SIGTERM)
        crash = d.wait_for("crash", count=2, timeout=90)
        assert crash["remedy"] == "restart", crash
        d.wait_for("server_ready", count=3, timeout=READY_S)

        # the daemon SIGKILLed mid-stop (its server draining), started again: the old server
        # is stopped before the new launch; serving
        old = int(d.wait_for("launch", attempt=3)["pid"])
        exited: dict[str, float] = {}
        watch_exit(old, exited)
        d.proc.send_signal(signal.SIGTERM)
        d.wait_for("state_changed", to="STOPPING", timeout=30)
        d.kill()
        assert _state(cfg)["state"] == "STOPPING"
        d = DaemonRun(cfg)
        _old_server_stopped_first(d, old, exited)

        # the daemon SIGKILLed mid-startup, started again: the same
        assert d.stop(timeout=120) == 0
        d = DaemonRun(cfg)
        old = int(d.wait_for("launch", timeout=60)["pid"])
        deadline = time.monotonic() + 30
        while _state(cfg).get("server_pgid") != old and time.monotonic() < deadline:
            time.sleep(0.1)
        exited = {}
        watch_exit(old, exited)
        d.kill()
        assert _state(cfg)["state"] == "STARTING"
        d = DaemonRun(cfg)
        _old_server_stopped_first(d, old, exited)
        assert d.stop(timeout=120) == 0
    finally:
        d.kill()

    # slow start past startup_timeout_s: stopped and relaunched
    (tmp_path / "slow").mkdir()
    slow = nights.real_config(tmp_path / "slow", real_sglang, {"health": {"startup_timeout_s": 8.0}}, name="slow")
    with DaemonRun(slow) as s:
        crash = s.wait_for("crash", timeout=120)
        assert crash["cause"] == "startup_timeout", crash
        s.wait_for("launch", attempt=2, timeout=90)
        assert s.stop(timeout=120) == 0
