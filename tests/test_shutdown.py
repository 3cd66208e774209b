"""A stop always ends (issue 22): past its deadline the daemon says what was pending and leaves.

A real daemon (a subprocess, the CLI's own ``run_daemon_async`` with the real adapters)
against the simulator and a real mosquitto, with one background task planted that ignores
its cancellation: the bug class that once kept a daemon alive for 22 minutes after SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness import REPO, read_events, write_config

from supervisor.core.config import load_config
from supervisor.daemon import EXIT_SHUTDOWN_OVERDUE, SHUTDOWN_MARGIN_S, shutdown_deadline_s
from tests.mosquitto import Broker, retained

pytestmark = pytest.mark.integration

# The CLI's daemon, with one task that swallows every cancellation.
DRIVER = textwrap.dedent("""
    import asyncio, sys
    from supervisor.cli.run import run_daemon_async
    from supervisor.core.config import load_config

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # the planted bug
                continue

    def plant(daemon):
        daemon.spawn(stubborn(), "planted-stubborn")

    cfg = load_config(sys.argv[1])
    sys.exit(asyncio.run(run_daemon_async(cfg, config_path=sys.argv[1], on_daemon=plant)))
""")


async def test_a_task_that_ignores_its_cancellation_cannot_hold_the_stop(tmp_path: Path, no_leftovers: str) -> None:
    with Broker(tmp_path / "broker") as broker:
        cfg_path = write_config(tmp_path, {
            "server": {"stop_grace_s": 1.0},
            "mqtt": {"enabled": True, "host": broker.host, "port": broker.port, "topic_prefix": "t",
                     "instance": "overdue", "reconnect_initial_s": 0.2, "reconnect_max_s": 1.0},
        })
        deadline = shutdown_deadline_s(load_config(cfg_path))
        assert deadline == 1.0 + SHUTDOWN_MARGIN_S
        driver = tmp_path / "driver.py"
        driver.write_text(DRIVER)
        log = tmp_path / "daemon.jsonl"
        with log.open("ab") as err:
            proc = subprocess.Popen([sys.executable, str(driver), str(cfg_path)], stdout=subprocess.DEVNULL,
                                    stderr=err, cwd=REPO, start_new_session=True)
        try:
            t0 = time.monotonic()
            while not any(e.get("event") == "server_ready" for e in read_events(log)):
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() - t0 < 60, "the server never became ready"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(deadline + 30)  # it ends by itself: nothing kills it here
        finally:
            if proc.poll() is None:
                import os

                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        events = read_events(log)
        overdue = [e for e in events if e.get("event") == "shutdown_overdue"]
        assert code == EXIT_SHUTDOWN_OVERDUE, log.read_text()[-3000:]
        assert len(overdue) == 1, overdue
        line = overdue[0]
        assert line["deadline_s"] == deadline and line["exit_code"] == EXIT_SHUTDOWN_OVERDUE
        planted = [p for p in line["pending"] if p.startswith("planted-stubborn: ")]
        assert planted and "driver.py" in planted[0] and " stubborn" in planted[0], line["pending"]
        # The server was stopped as on any stop, before the deadline came.
        names = [e.get("event") for e in events]
        assert names.index("server_stopped") < names.index("shutdown_overdue")
        assert "offline_not_published" not in names
        # The retained status is `offline`, published by the daemon's last connection (not
        # only its Last Will): the broker saw the client "<id>-last" connect.
        kept = await retained(broker, "t/#")
        status = [r for topic, r in kept.items() if topic.endswith("/status")]
        assert [r.payload for r in status] == [b"offline"]
        assert "-last" in broker.log_file.read_text(errors="replace")
