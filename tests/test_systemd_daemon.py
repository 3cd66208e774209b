"""The real daemon under a fake systemd: READY/STATUS/WATCHDOG/STOPPING, SIGTERM and SIGHUP.

Runs ``python -m supervisor.cli run --config F`` against the simulator, with NOTIFY_SOCKET
pointing at a real datagram socket that plays systemd's side (``NotifyListener``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import free_port, wait_until
from harness import stop_daemon, stop_timeout_s
from test_sdnotify import Message, NotifyListener

pytestmark = pytest.mark.integration

WATCHDOG_USEC = 200_000  # pings expected every 0.1 s
STOP_GRACE_S = 5.0
DEADLINE_S = 60.0  # generous: two shared CPU cores


def config_text(port: int, state_dir: Path) -> str:
    """A config that supervises the simulator on ``port`` (the contract the daemon must accept)."""
    command = json.dumps([sys.executable, "-m", "supervisor.sim.simulator", "--sim-load-s", "0.2"])
    return f"""
[server]
command = {command}
model_path = "sim/kimi"
port = {port}
tp_size = 2
stop_grace_s = {STOP_GRACE_S}

[health]
interval_s = 0.5
timeout_s = 2
startup_poll_s = 0.1

[state]
dir = {json.dumps(str(state_dir))}

[metrics]
enabled = false

[logging]
format = "json"
"""


@dataclass
class Daemon:
    """A running daemon, its config file, its stderr file and systemd's end of the socket."""

    proc: subprocess.Popen[bytes]
    config: Path
    stderr: Path
    notify: NotifyListener

    def log_tail(self) -> str:
        """The last lines the daemon wrote to stderr."""
        return "\n".join(self.stderr.read_text(errors="replace").splitlines()[-30:])

    def wait_for(self, predicate: Callable[[Message], bool], what: str, after: int = 0) -> Message:
        """A notify message satisfying ``predicate``; fails at once if the daemon has exited."""
        def seen() -> Message | None:
            return next((m for m in self.notify.messages[after:] if predicate(m)), None)

        def found() -> Message | None:
            if self.proc.poll() is None:
                return seen()
            # It exited: what it sent before exiting counts (the listener drains every 50 ms).
            time.sleep(0.2)
            message = seen()
            if message is None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}) waiting for {what}:\n{self.log_tail()}")
            return message

        return wait_until(found, timeout=DEADLINE_S, what=what)

    def server_processes(self) -> list[psutil.Process]:
        """The daemon's live descendants (the simulated SGLang tree)."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def json_events(self, name: str) -> list[dict[str, object]]:
        """Every JSON log line on stderr whose ``event`` is ``name``."""
        events = []
        for line in self.stderr.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == name:
                events.append(record)
        return events


@pytest.fixture
def daemon(tmp_path: Path, no_leftovers: None) -> Iterator[Daemon]:
    """The daemon started as systemd would start it (NOTIFY_SOCKET, WATCHDOG_USEC, no WATCHDOG_PID)."""
    notify = NotifyListener(str(tmp_path / "notify.sock"))
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    config = tmp_path / "kimi.toml"
    config.write_text(config_text(free_port(), state_dir))
    stderr = tmp_path / "daemon.stderr"
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env |= {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "run", "--config", str(config)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path,
            start_new_session=True,
        )
    handle = Daemon(proc, config, stderr, notify)
    try:
        yield handle
    finally:
        try:
            if proc.poll() is None:
                stop_daemon(proc, stderr, stop_timeout_s(config))
        finally:
            notify.close()


def serving(d: Daemon) -> Message:
    """Wait for READY=1 and then a STATUS= line saying the server is READY."""
    d.wait_for(lambda m: m.get("READY") == "1", "READY=1")
    return d.wait_for(lambda m: m.get("STATUS", "").startswith("READY"), "STATUS=READY ...")


def test_daemon_tells_systemd_ready_status_watchdog_and_stopping(daemon: Daemon) -> None:
    """READY=1, a READY status line, WATCHDOG=1 about every WATCHDOG_USEC/2, then SIGTERM => STOPPING=1
    at once (before the server's drain ends, not after it) and exit 0."""
    status = serving(daemon)
    assert "fraction=" in status["STATUS"] and "\n" not in status["STATUS"]
    first = len(daemon.notify.messages)
    wait_until(lambda: len([m for m in daemon.notify.messages[first:] if "WATCHDOG" in m]) >= 10,
               timeout=DEADLINE_S, what="10 watchdog pings")
    pings = [t for t, m in daemon.notify.timed()[first:] if "WATCHDOG" in m]
    mean_gap = (pings[-1] - pings[0]) / (len(pings) - 1)
    interval = WATCHDOG_USEC / 2 / 1e6
    assert 0.5 * interval <= mean_gap <= 4 * interval

    server = daemon.server_processes()
    assert server, "the simulated server should be running"
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.wait_for(lambda m: m.get("STOPPING") == "1", "STOPPING=1")
    assert daemon.proc.wait(timeout=STOP_GRACE_S + DEADLINE_S) == 0, daemon.log_tail()
    stopping_at = next(t for t, m in daemon.notify.timed() if m.get("STOPPING") == "1")
    [stopped] = daemon.json_events("server_stopped")
    assert stopping_at < float(stopped["mono"]), "STOPPING=1 came only after the server had stopped"
    _, alive = psutil.wait_procs(server, timeout=10)
    assert not alive, f"SGLang outlived the daemon: {alive}"


@pytest.mark.parametrize(
    "broken",
    ["[server\ncommand = ", "[server]\nmodel_path = \"sim/kimi\"\ntp_size = 0\n"],
    ids=["not-toml", "invalid-value"],
)
def test_sighup_with_a_broken_config_keeps_running_on_the_old_one(daemon: Daemon, broken: str) -> None:
    """SIGHUP with a broken config: RELOADING=1 then READY=1, the error is logged, the server keeps running."""
    serving(daemon)
    server_pids = {p.pid for p in daemon.server_processes()}
    assert server_pids
    daemon.config.write_text(broken)
    before = len(daemon.notify.messages)
    daemon.proc.send_signal(signal.SIGHUP)
    reload_msg = daemon.wait_for(lambda m: m.get("RELOADING") == "1", "RELOADING=1", after=before)
    assert int(reload_msg["MONOTONIC_USEC"]) > 0
    after_reload = daemon.notify.messages.index(reload_msg, before) + 1
    daemon.wait_for(lambda m: m.get("READY") == "1", "READY=1 after the reload", after=after_reload)
    wait_until(lambda: daemon.json_events("config_reloaded"), timeout=DEADLINE_S, what="config_reloaded log line")
    assert [e.get("ok") for e in daemon.json_events("config_reloaded")] == [False]
    assert daemon.proc.poll() is None
    assert server_pids <= {p.pid for p in daemon.server_processes()}, "the server was restarted"

    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=STOP_GRACE_S + DEADLINE_S) == 0, daemon.log_tail()
