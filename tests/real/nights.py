"""One scripted night, driven the same way against the real SGLang and against the simulator.

``write_config`` makes a daemon config whose only difference between the two is
``[server] command``. ``drive`` runs the scenarios of issue 12 in order on one daemon (start
to READY; a SIGKILLed scheduler with no OOM-killer record; the same with a cgroup
``oom_kill`` record; a planned restart with requests in flight; a hang; a planned stop with
requests in flight) and returns what the daemon did, as a ``Night``. ``conformance`` is the
part of a ``Night`` that the simulator must reproduce: the state path, each crash's cause,
phase and remedy, and the failed-request counts; timings are kept apart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import tomli_w

from tests.harness import REPO, DaemonRun

sys.path.insert(0, str(REPO / "tests"))
from conftest import free_port_for_later  # noqa: E402

REQUEST_TOKENS = 1200  # about 3 s of decoding for the tiny model on this CPU: in flight for sure
IN_FLIGHT = 4


def write_config(tmp: Path, command: list[str], *, model: str, env: dict[str, str],
                 sections: dict[str, dict[str, Any]] | None = None, name: str = "night") -> Path:
    """A daemon config for a fast night; ``command`` is the only part that differs per server."""
    tags = {name: os.environ[name] for name in ("SGLANG_SUPERVISOR_TEST_ID", "SGLANG_SUPERVISOR_TEST_RUN")
            if os.environ.get(name)}  # the test's and the run's: its servers can be found (tests/conftest.py)
    events = tmp / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
    base: dict[str, dict[str, Any]] = {
        "server": {
            "command": command,
            "model_path": model,
            "port": free_port_for_later(),  # bound only after the model load
            "stop_grace_s": 30.0,
            "env": {**env, **tags},
        },
        "health": {"interval_s": 1.0, "timeout_s": 5.0, "failures": 2, "startup_timeout_s": 240.0,
                   "startup_poll_s": 0.25, "hang_dump_wait_s": 10.0},
        "policy": {"backoff_initial_s": 0.5, "backoff_max_s": 2.0, "stable_after_s": 600.0},
        "gpu": {"backend": "none"},
        "metrics": {"enabled": False},
        "logging": {"format": "json", "memory_events": str(events)},
        "state": {"dir": str(tmp / "state")},
    }
    for section, keys in (sections or {}).items():
        base.setdefault(section, {}).update(keys)
    path = tmp / f"{name}.toml"
    path.write_text(tomli_w.dumps(base))
    path.chmod(0o644)
    return path


def real_config(tmp: Path, real: Any, sections: dict[str, dict[str, Any]] | None = None, *,
                env: dict[str, str] | None = None, name: str = "night") -> Path:
    """The real server's config: the CPU flags ride in ``[server] command`` so that a simulator
    config differs from it in that one key only."""
    return write_config(
        tmp, [*real.command(), *real.extra_args], model=real.model, env={**real.env, **(env or {})},
        sections=sections, name=name,
    )


def sim_config(tmp: Path, real: Any, name: str = "sim-night") -> Path:
    """The same night's config with the simulator as ``[server] command`` (nothing else differs)."""
    return write_config(tmp, [sys.executable, "-m", "supervisor.sim.simulator"], model=real.model, env=dict(real.env),
                        name=name)


def config_of(path: Path) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(path.read_text())


# --- the server's processes -------------------------------------------------------------------


def tree(pid: int) -> list[psutil.Process]:
    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def part(pid: int, prefix: str = "sglang::scheduler", timeout: float = 30.0) -> psutil.Process:
    """The first process of ``pid``'s tree whose title starts with ``prefix``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in tree(pid)[1:]:
            try:
                if (p.cmdline() or [""])[0].startswith(prefix) or p.name().startswith(prefix[:15]):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no {prefix} under pid {pid}: {[(p.pid, p.name()) for p in tree(pid)]}")


def all_gone(procs: list[psutil.Process], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


# --- client load ------------------------------------------------------------------------------


class Requests:
    """``n`` concurrent /generate requests in threads; ``failed`` counts non-200 answers and errors."""

    def __init__(self, port: int, n: int = IN_FLIGHT, tokens: int = REQUEST_TOKENS) -> None:
        self.url = f"http://127.0.0.1:{port}/generate"
        self.body = json.dumps({"text": "the night shift", "sampling_params": {
            "max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}).encode()
        self.results: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._one, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _one(self) -> None:
        req = urllib.request.Request(self.url, self.body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
                outcome = str(r.status)
        except urllib.error.HTTPError as e:
            outcome = str(e.code)
        except Exception as e:  # noqa: BLE001 - every failure counts, whatever its kind
            outcome = type(e).__name__
        with self._lock:
            self.results.append(outcome)

    def join(self, timeout: float = 150.0) -> list[str]:
        for t in self._threads:
            t.join(timeout)
        return list(self.results)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if r != "200")


# --- the night --------------------------------------------------------------------------------


@dataclass
class Night:
    states: list[str] = field(default_factory=list)
    crashes: list[dict[str, Any]] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)
    results: dict[str, list[str]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    leftovers: dict[str, list[int]] = field(default_factory=dict)
    exit_code: int | None = None
    restart_output: str = ""
    config: Path | None = None  # the daemon's config (its state directory holds the night's journal)

    def conformance(self) -> dict[str, Any]:
        """What the simulator must reproduce: no timings."""
        return {
            "states": self.states,
            "crashes": [{k: c.get(k) for k in ("cause", "phase", "remedy")} for c in self.crashes],
            "failed": self.failed,
            "exit_code": self.exit_code,
        }


def _ts(event: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _kill_part(d: DaemonRun, night: Night, key: str, launch: int, sig: int = signal.SIGKILL) -> None:
    """Kill (or stop) the scheduler of launch ``launch`` and time what the daemon does."""
    pid = int(d.wait_for("launch", attempt=launch)["pid"])
    victims = tree(pid)
    sched = part(pid)
    t0 = time.time()
    os.kill(sched.pid, sig)
    night.timings[f"{key}_t0"] = t0
    night.leftovers[key] = [p.pid for p in victims]


def drive(config: Path, *, ready_timeout: float = 200.0) -> Night:
    """The scripted night on one daemon. Raises AssertionError (with the daemon's log tail) when
    a step does not happen in time; the daemon and its server are stopped in any case."""
    night = Night(config=config)
    port = int(config_of(config)["server"]["port"])
    events_file = Path(config_of(config)["logging"]["memory_events"])
    d = DaemonRun(config)
    try:
        # 1. start to READY
        d.wait_for("server_ready", timeout=ready_timeout)

        # 2. a scheduler SIGKILLed from outside, no OOM-killer record
        _kill_part(d, night, "sigkill", 1)
        down = d.wait_for("server_down", count=1, timeout=30)
        died = d.wait_for("state_changed", to="EXITED", timeout=30)
        night.timings["sigkill_noticed_s"] = _ts(died) - night.timings["sigkill_t0"]
        night.timings["sigkill_down_alert_s"] = _ts(down) - night.timings["sigkill_t0"]
        night.crashes.append(d.wait_for("crash", count=1, timeout=60))
        relaunch = d.wait_for("launch", attempt=2, timeout=60)
        night.timings["sigkill_relaunch_s"] = _ts(relaunch) - night.timings["sigkill_t0"]
        ready = d.wait_for("server_ready", count=2, timeout=ready_timeout)
        night.timings["sigkill_ready_s"] = _ts(ready) - night.timings["sigkill_t0"]
        night.leftovers["sigkill"] = _alive(night.leftovers["sigkill"])

        # 2b. the same, with the cgroup's oom_kill count raised while it ran (the kernel's record)
        events_file.write_text(events_file.read_text().replace("oom_kill 0", "oom_kill 1"))
        _kill_part(d, night, "oom", 2)
        night.crashes.append(d.wait_for("crash", count=2, timeout=60))
        d.wait_for("server_ready", count=3, timeout=ready_timeout)
        night.leftovers["oom"] = _alive(night.leftovers["oom"])

        # 4a. a planned restart (the restart command) with requests in flight
        load = Requests(port)
        time.sleep(0.7)
        t0 = time.time()
        cmd = subprocess.run(
            [sys.executable, "-m", "supervisor.cli", "restart", "--config", str(config), "--timeout", "240"],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )
        night.restart_output = cmd.stdout + cmd.stderr
        night.timings["restart_ready_s"] = time.time() - t0
        night.results["restart"] = load.join()
        night.failed["restart"] = load.failed
        if cmd.returncode != 0:
            raise AssertionError(f"restart exited {cmd.returncode}: {night.restart_output}")

        # 5. a hang: the scheduler stopped (SIGSTOP): health fails, SIGQUIT, killed, relaunched
        _kill_part(d, night, "hang", 4, signal.SIGSTOP)
        night.crashes.append(d.wait_for("crash", count=3, timeout=90))
        d.wait_for("server_ready", count=5, timeout=ready_timeout)
        night.timings["hang_ready_s"] = time.time() - night.timings["hang_t0"]
        night.leftovers["hang"] = _alive(night.leftovers["hang"])

        # 4b. a planned stop (SIGTERM to the daemon) with requests in flight
        last = tree(int(d.wait_for("launch", attempt=5)["pid"]))
        load = Requests(port)
        time.sleep(0.7)
        night.exit_code = d.stop()
        night.results["stop"] = load.join()
        night.failed["stop"] = load.failed
        night.leftovers["stop"] = _alive([p.pid for p in last])
    finally:
        if d.proc.poll() is None:
            d.stop()
        night.events = d.events()
        night.states = [e["to"] for e in night.events if e.get("event") == "state_changed"]
    return night


def _alive(pids: list[int], timeout: float = 15.0) -> list[int]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    all_gone(procs, timeout)
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out
