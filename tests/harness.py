"""Runs the real daemon (a subprocess) against the real simulator, and reads its JSON log.

Every daemon gets free ports, its own state and simulated-GPU directories, and a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import tomli_w
from conftest import free_port

REPO = Path(__file__).resolve().parent.parent


def _test_id_env() -> dict[str, str]:
    """The running test's id (see conftest.no_leftovers) and the run's tag (conftest's
    end-of-run check), so the servers a daemon launches can be found."""
    return {name: os.environ[name] for name in ("SGLANG_SUPERVISOR_TEST_ID", "SGLANG_SUPERVISOR_TEST_RUN")
            if os.environ.get(name)}


def sim_command(*sim_args: str, load_s: float = 0.2) -> list[str]:
    # The drain is polled every 5 s by 0.5.23; 0.25 s keeps planned stops of fast tests fast.
    return [sys.executable, "-m", "supervisor.sim.simulator", "--sim-load-s", str(load_s), "--sim-drain-poll-s", "0.25",
            *sim_args]


def write_config(tmp: Path, sections: dict[str, dict[str, Any]] | None = None, *, sim_args: tuple[str, ...] = (), name: str = "test") -> Path:
    """A config for a fast simulated night; ``sections`` override keys."""
    state = tmp / "state"
    gpus = tmp / "gpus"
    base: dict[str, dict[str, Any]] = {
        "server": {
            "command": sim_command(*sim_args),
            "model_path": "moonshotai/Kimi-K2.5",
            "port": free_port(),
            "tp_size": 2,
            "mem_fraction_static": 0.93,
            "stop_grace_s": 3.0,
            # SGLang's own switches for its crash diagnostics, off as in the real tier: no 5 s
            # sleep and no 60 s coredump wait before the tree is killed
            "env": {"SGLANG_SIM_GPU_DIR": str(gpus), "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
                    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0", **_test_id_env()},
        },
        "health": {"interval_s": 0.3, "timeout_s": 2.0, "failures": 2, "startup_timeout_s": 30.0, "startup_poll_s": 0.1},
        "policy": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, "stable_after_s": 60.0},
        "gpu": {"backend": "simulated", "sim_dir": str(gpus), "interval_s": 0.5, "release_timeout_s": 5.0,
                "headroom_action": "warn"},
        "metrics": {"enabled": False},
        "logging": {"format": "json"},
        "state": {"dir": str(state)},
    }
    for section, keys in (sections or {}).items():
        base.setdefault(section, {}).update(keys)
    from supervisor.sim import simgpu

    simgpu.ensure_gpus(gpus, 8, 96)
    path = tmp / f"{name}.toml"
    path.write_text(tomli_w.dumps(base))
    path.chmod(0o644)
    return path


def merge_servers(configs: Sequence[Path], path: Path, gpus: Sequence[Sequence[int]] = ()) -> Path:
    """One daemon's config owning the servers of ``configs`` (each a single-``[server]``
    config, its file stem the server's name) as ``[[server]]`` entries; the other sections
    come from the first. ``gpus``: each server's ``[server.gpu] indices``; with simulated
    GPUs every server then uses the first config's simulated-GPU directory."""
    import tomllib

    docs = [tomllib.loads(c.read_text()) for c in configs]
    merged: dict[str, Any] = {k: v for k, v in docs[0].items() if k != "server"}
    merged["server"] = []
    sim_dir = docs[0].get("gpu", {}).get("sim_dir")
    for i, (cfg, doc) in enumerate(zip(configs, docs, strict=True)):
        entry = {"name": cfg.stem, **doc["server"]}
        if gpus:
            entry["gpu"] = {"indices": list(gpus[i])}
            if sim_dir:
                entry["env"] = {**entry.get("env", {}), "SGLANG_SIM_GPU_DIR": sim_dir}
        merged["server"].append(entry)
    path.write_text(tomli_w.dumps(merged))
    path.chmod(0o644)
    return path


def read_events(log: Path) -> list[dict[str, Any]]:
    """The JSON lines of a daemon's log (other lines, a traceback's say, are skipped)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class DaemonHung(AssertionError):
    """A daemon did not exit in time after SIGTERM: it was SIGKILLed with its process group."""


# Beyond the daemon's own shutdown deadline (which ends a stuck stop by itself, exit 3):
# what a loaded CI machine may add before the test calls it hung.
STOP_SLACK_S = 15.0


def stop_timeout_s(config: Path) -> float:
    """How long a test waits for a daemon on ``config`` to exit after SIGTERM: its shutdown
    deadline (``supervisor.daemon.shutdown_deadline_s``) plus ``STOP_SLACK_S``."""
    from supervisor.core.config import ConfigError, load_config
    from supervisor.daemon import shutdown_deadline_s

    try:
        return shutdown_deadline_s(load_config(config)) + STOP_SLACK_S
    except (ConfigError, OSError):
        return 60.0 + STOP_SLACK_S  # a config the daemon refused too: it exits at once anyway


def overdue_line(log: Path) -> str | None:
    """The daemon's ``shutdown_overdue`` line (what was pending, and where), if it wrote one."""
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if "shutdown_overdue" in line:
                return line[:4000]
    return None


def stop_daemon(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> int:
    """SIGTERM, then wait ``timeout``; a daemon still there is SIGKILLed with its process
    group (it was started in a session of its own) and the test fails with its pending-task
    line. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        said = overdue_line(log) or "no shutdown_overdue line: " + log.read_text(errors="replace")[-1500:]
        raise DaemonHung(f"daemon {proc.pid} did not exit {timeout:g} s after SIGTERM (SIGKILLed): {said}") from None


class DaemonRun:
    """``sglang-supervisor run`` as a subprocess in a session of its own, its stderr (JSON
    lines) in a file."""

    def __init__(self, config: Path, *extra: str, env: dict[str, str] | None = None,
                 wrapper: Sequence[str] = (), tree: Path = REPO) -> None:
        """``tree``: the checkout whose package runs (``python -m`` puts its cwd first)."""
        self.config = config
        n = 1
        while config.with_suffix(f".{n}.log.jsonl").exists():
            n += 1
        self.log_path = config.with_suffix(f".{n}.log.jsonl")  # one file per daemon run
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "supervisor.cli", "run", "--config", str(config), *extra],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            cwd=tree,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its process group is its own: killed whole if it hangs
        )

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.log_path)

    def find(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == event and all(e.get(k) == v for k, v in match.items())]

    def wait_for(self, event: str, timeout: float = 30.0, count: int = 1, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            found = self.find(event, **match)
            if len(found) >= count:
                return found[count - 1]
            if self.proc.poll() is not None and not self.find(event, **match):
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"daemon exited {self.proc.returncode} before {event} {match}:\n{tail}")
            if time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"no {event} {match} within {timeout}s:\n{tail}")
            time.sleep(0.05)

    def states(self) -> list[str]:
        return [e["to"] for e in self.find("state_changed")]

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM and wait (by default the daemon's shutdown deadline plus slack); a daemon
        that hangs is SIGKILLed with its group and raises ``DaemonHung``."""
        try:
            return stop_daemon(self.proc, self.log_path, stop_timeout_s(self.config) if timeout is None else timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> DaemonRun:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()
        self._log.close()


def simulator_mains(test_id: str | None = None) -> list[int]:
    """Pids of live simulator main processes: not a child of another simulator (a fork
    that has not set its title yet) and not a zombie. For 'never two servers'. With
    ``test_id``, only those started for that test (see conftest.no_leftovers)."""
    import psutil

    test_id = test_id or os.environ.get("SGLANG_SUPERVISOR_TEST_ID")
    sims: dict[int, int] = {}
    for p in psutil.process_iter(["cmdline", "status", "ppid"]):
        try:
            cmd = p.info["cmdline"] or []
            if "supervisor.sim.simulator" not in cmd or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if test_id and p.environ().get("SGLANG_SUPERVISOR_TEST_ID") != test_id:
                continue
            sims[p.pid] = p.info["ppid"]
        except psutil.Error:
            continue
    return [pid for pid, ppid in sims.items() if ppid not in sims]


class ServerCounter:
    """Samples the number of live simulator servers in a thread; ``max`` is the peak."""

    def __init__(self, interval: float = 0.05) -> None:
        import threading

        self.test_id = os.environ.get("SGLANG_SUPERVISOR_TEST_ID")
        self.max = 0
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max = max(self.max, len(simulator_mains(self.test_id)))
            self._stop.wait(self._interval)

    def close(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.max


def iter_lines(path: Path) -> Iterator[str]:
    yield from path.read_text(errors="replace").splitlines()


# --- scoped process accounting (added for the chaos matrix and the soak) --------------------
# Other tests (and other people's demos) may run simulators on this machine at the same
# time: these helpers only count the processes of one server port and one simulated-GPU dir.


def simulator_mains_on(port: int) -> list[int]:
    """Like ``simulator_mains`` but only the simulators serving ``--port port``."""
    import psutil

    wanted = str(port)
    sims: dict[int, int] = {}
    for p in psutil.process_iter(["cmdline", "status", "ppid"]):
        try:
            cmd = p.info["cmdline"] or []
            if "supervisor.sim.simulator" not in cmd or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(a == "--port" and i + 1 < len(cmd) and cmd[i + 1] == wanted for i, a in enumerate(cmd)):
                sims[p.pid] = p.info["ppid"]
        except psutil.Error:
            continue
    return [pid for pid, ppid in sims.items() if ppid not in sims]


class ProcessWatch:
    """Samples in a thread: the peak number of simulator servers on ``port`` (never two
    servers), and every process that belonged to them, to the ``roots`` (daemons) or held
    memory in ``gpu_dir``; ``leftovers()`` lists those still present (running or zombie)."""

    def __init__(self, port: int, *, gpu_dir: Path | None = None, interval: float = 0.1) -> None:
        import threading

        self.port = port
        self.gpu_dir = gpu_dir
        self.max_servers = 0
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start since boot, name)
        self._roots: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"process-watch-{port}")
        self._thread.start()

    def add_root(self, pid: int) -> None:
        """Also account for ``pid`` and its descendants (a daemon we started)."""
        with self._lock:
            self._roots.add(pid)

    def _note(self, proc: Any) -> None:
        import psutil

        from supervisor.adapters.procstart import started

        try:
            self.seen.setdefault(proc.pid, (started(proc.pid), proc.name()))
        except psutil.Error:
            pass

    def sample(self) -> None:
        """One sample (the thread calls this; tests may call it at a moment that matters)."""
        import psutil

        mains = simulator_mains_on(self.port)
        with self._lock:
            self.max_servers = max(self.max_servers, len(mains))
            roots = [*self._roots, *mains]
            for pid in roots:
                try:
                    proc = psutil.Process(pid)
                    kids = proc.children(recursive=True)
                except psutil.Error:
                    continue
                if pid in mains:
                    self._note(proc)
                for kid in kids:
                    self._note(kid)
            if self.gpu_dir is not None:
                from supervisor.sim import simgpu

                for holder in simgpu.read_processes(self.gpu_dir):
                    if holder.alive:
                        try:
                            self._note(psutil.Process(holder.pid))
                        except psutil.Error:
                            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval)

    def close(self) -> int:
        """Stop sampling; returns the peak number of servers seen at once."""
        self._stop.set()
        self._thread.join(10)
        return self.max_servers

    def leftovers(self) -> list[str]:
        """Seen processes that still exist (same pid and start), zombies included."""
        import psutil

        from supervisor.adapters.procstart import still

        left = []
        with self._lock:
            items = list(self.seen.items())
        for pid, (start, name) in items:
            try:
                if still(pid, start):
                    left.append(f"{pid} {name} ({psutil.Process(pid).status()})")
            except psutil.Error:
                continue
        return left


def watch_exit(pid: int, out: dict[str, float]) -> threading.Thread:
    """Polls every millisecond for ``pid``'s end (``out["at"]``, monotonic)."""
    import psutil

    def run() -> None:
        try:
            proc = psutil.Process(pid)
            while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.001)
        except psutil.Error:
            pass
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
