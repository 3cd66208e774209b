"""Re-exec in place, end to end: the real daemon (a subprocess) re-executes itself while the
real simulator serves, and adopts it where it stands (docs/upgrade.md).

Each test runs ``sglang-supervisor reexec`` (or plants what makes the daemon re-exec on its
own) and reads what happened from the processes themselves and the daemon's JSON log.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
from conftest import wait_until
from harness import REPO, DaemonRun, simulator_mains, write_config


def _reexec(config: Path, tree: Path = REPO, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "reexec", "--config", str(config), "--timeout", "60"],
        capture_output=True, text=True, timeout=timeout, cwd=tree, check=False,
    )


class Client(threading.Thread):
    """Asks the server one numbered request after another, through the re-exec: each answered
    one must be in the server's log exactly once."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.answered: list[int] = []
        self.failed = 0
        self.halt = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.halt.is_set():
            n += 1
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health?req={n}", timeout=5) as r:
                    if r.status == 200:
                        self.answered.append(n)
            except OSError:
                self.failed += 1
            time.sleep(0.01)


def _planted(tmp: Path, code: str) -> dict[str, str]:
    """An environment whose Python runs ``code`` first (a sitecustomize): what the test plants."""
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def _port(config: Path) -> int:
    import tomllib

    return int(tomllib.loads(config.read_text())["server"]["port"])


def test_reexec_adopts_the_server_where_it_stands_and_loses_no_line(tmp_path, no_leftovers):
    """Same daemon pid, same server pid and launch, no relaunch, every request's log line
    once; then a server killed after the exec is noticed, diagnosed and relaunched as usual."""
    config = write_config(tmp_path, {"health": {"interval_s": 0.2}})
    with DaemonRun(config) as d:
        ready = d.wait_for("server_ready", timeout=60)
        launched = d.find("launch")[-1]
        client = Client(_port(config))
        client.start()
        wait_until(lambda: len(client.answered) > 20, 20, 0.05, "requests answered before the exec")
        done = _reexec(config)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "(unchanged)" in done.stdout and ": adopted" in done.stdout, done.stdout
        said = d.wait_for("reexec", timeout=30)
        assert not said.get("relaunching") and said["adopted"] and said["pid"] == d.proc.pid
        assert said["gap_s"] is not None and said["gap_s"] < 10.0
        answered_at_exec = len(client.answered)
        wait_until(lambda: len(client.answered) > answered_at_exec + 20, 20, 0.05, "requests answered after the exec")
        client.halt.set()
        client.join(10)
        assert client.failed == 0
        assert psutil.pid_exists(launched["pid"]) and d.proc.poll() is None
        assert len(d.find("launch")) == 1 and len(d.find("server_ready")) == 1, "relaunched"
        server_log = Path(tmp_path) / "state" / "server.log"
        last = f"GET /health?req={client.answered[-1]} "  # the pump reads at its pace: the last line once there
        wait_until(lambda: last in server_log.read_text(errors="replace"), 10, 0.05, "the last request's line")
        log = server_log.read_text(errors="replace")
        seen = [int(n) for n in re.findall(r"GET /health\?req=(\d+) ", log)]
        assert sorted(seen) == sorted(set(seen)), "a line twice"
        missing = set(client.answered) - set(seen)
        assert not missing, f"{len(missing)} answered requests not in the log, e.g. {sorted(missing)[:5]}"
        # The adopted server's death is its own again: noticed, read and relaunched.
        os.kill(launched["pid"], signal.SIGKILL)
        d.wait_for("server_ready", timeout=60, count=2)
        assert d.find("server_down") and d.find("crash"), "the death was noticed and diagnosed"
        assert d.find("launch")[-1]["pid"] != launched["pid"]
        assert ready["attempt"] < d.find("server_ready")[-1]["attempt"]
        assert d.stop() == 0


def test_a_hand_over_the_new_code_cannot_read_stops_and_relaunches_with_why(tmp_path, no_leftovers):
    """A newer hand-over format (planted: the re-executed program reads another one): the
    server is not left unsupervised, it is stopped and relaunched, and the reexec says why."""
    env = _planted(tmp_path, (
        "import os\n"
        "if os.environ.get('SGLANG_SUPERVISOR_HANDOVER'):\n"
        "    import supervisor.services.reexec\n"
        "    supervisor.services.reexec.HANDOVER_VERSION = 99\n"
    ))
    config = write_config(tmp_path)
    with DaemonRun(config, env=env) as d:
        d.wait_for("server_ready", timeout=60)
        old = d.find("launch")[-1]["pid"]
        done = _reexec(config)
        assert done.returncode == 1 and "relaunched" in done.stderr, done.stdout + done.stderr
        said = d.wait_for("reexec", timeout=30)
        assert not said.get("adopted") and said["relaunching"] and "format 1" in said["why_not"]
        d.wait_for("server_ready", timeout=60, count=2)
        assert d.find("launch")[-1]["pid"] != old
        wait_until(lambda: not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE,
                   20, 0.1, "the old server gone")
        assert len(simulator_mains(no_leftovers)) == 1 and d.proc.pid == said["pid"]
        assert d.stop() == 0


def test_a_daemon_bug_reexecs_in_place_three_times_an_hour_then_exits(tmp_path, no_leftovers):
    """A planted bug (the diagnosis's warm-up task raises, in every program): each time a
    re-exec, the server untouched; the fourth in the hour exits as before (code 1)."""
    env = _planted(tmp_path, (
        "def _broken():\n"
        "    raise RuntimeError('planted bug')\n"
        "import supervisor.core.diagnosis as d\n"
        "d.warm = _broken\n"
    ))
    config = write_config(tmp_path)
    with DaemonRun(config, env=env) as d:
        d.wait_for("server_ready", timeout=60)
        pid = d.find("launch")[-1]["pid"]
        d.wait_for("reexec", timeout=60, count=3)
        assert [e["adopted"] != [] for e in d.find("reexec")] == [True] * 3
        assert all(e["pid"] == d.proc.pid for e in d.find("reexec"))
        assert d.proc.wait(60) == 1
        failed = d.find("daemon_failed")
        assert [e.get("reexec", False) for e in failed] == [True, True, True, False]
        assert len(d.find("launch")) == 1, "relaunched by a re-exec"
        assert d.find("daemon_bug") and "planted bug" in d.find("daemon_bug")[0]["traceback"]
        wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                   20, 0.1, "the server stopped by the exit")


def test_reexec_into_code_that_cannot_start_is_refused_and_the_old_daemon_supervises_on(tmp_path, no_leftovers):
    """The daemon's tree broken after it started (its entry point no longer imports): refused
    with one line and a ``reexec_refused`` alert; the same program supervises on."""
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "supervisor", tree / "supervisor", ignore=shutil.ignore_patterns("__pycache__"))
    config = write_config(tmp_path)
    with DaemonRun(config, tree=tree) as d:
        d.wait_for("server_ready", timeout=60)
        pid = d.find("launch")[-1]["pid"]
        cli = tree / "supervisor" / "cli" / "__init__.py"
        cli.write_text(cli.read_text() + "\ndef (:\n")
        done = _reexec(config)  # the CLI from the intact checkout
        assert done.returncode == 1, done.stdout + done.stderr
        assert "refused: the new code's '--version' failed" in done.stderr, done.stderr
        refused = d.wait_for("reexec_refused", timeout=10)
        assert "SyntaxError" in refused["error"]
        assert not d.find("reexec") and d.proc.poll() is None
        os.kill(pid, signal.SIGKILL)  # still supervised by the old program
        d.wait_for("server_ready", timeout=60, count=2)
        assert d.stop() == 0


async def test_reexec_keeps_the_broker_quiet_and_the_counters_counting(tmp_path, no_leftovers):
    """MQTT: a clean disconnect before the exec (the broker fires no ``offline`` Last Will)
    and ``online`` again from the new program. Metrics: the counters go on from their values
    (no reset) and count the re-exec."""
    import asyncio

    from conftest import free_port

    from tests.mosquitto import Broker, Collector

    metrics_port = free_port()
    with Broker(tmp_path / "broker") as broker:
        config = write_config(tmp_path, {
            "mqtt": {"enabled": True, "host": broker.host, "port": broker.port, "topic_prefix": "t",
                     "instance": "rx", "reconnect_initial_s": 0.2, "reconnect_max_s": 1.0},
            "metrics": {"enabled": True, "listen": f"127.0.0.1:{metrics_port}"},
        })
        async with Collector(broker, "t/#") as seen:
            with DaemonRun(config) as d:
                await asyncio.to_thread(d.wait_for, "server_ready", 60)
                status = await seen.wait_for(lambda: [m for m in seen.messages if m.payload == b"online"],
                                             what="online")
                topic = status[0].topic

                def scrape() -> str:
                    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
                        return r.read().decode()

                before = await asyncio.to_thread(scrape)
                assert re.search(r"^sglang_supervisor_launches_total(\{[^}]*\})? 1\.0$", before, re.M), before[:2000]
                done = await asyncio.to_thread(_reexec, config)
                assert done.returncode == 0, done.stdout + done.stderr
                await seen.wait_for(lambda: len([m for m in seen.messages
                                                 if m.topic == topic and m.payload == b"online"]) >= 2,
                                    what="online again")
                on_status = [m.payload for m in seen.messages if m.topic == topic]
                assert b"offline" not in on_status, on_status
                after = await asyncio.to_thread(scrape)
                assert re.search(r"^sglang_supervisor_launches_total(\{[^}]*\})? 1\.0$", after, re.M), after[:2000]
                assert re.search(r'^sglang_supervisor_events_total\{[^}]*event="reexec"[^}]*\} 1\.0$', after, re.M)
                assert d.stop() == 0
