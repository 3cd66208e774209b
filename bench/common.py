"""Plumbing shared by the benchmarks: settings, stamps, statistics, our daemon as a process.

Every process a benchmark starts carries ``SGLANG_BENCH_TAG`` in its environment (and the
test id of ``tests/conftest.py`` when one is set), so that ``reap_tagged`` can find and kill
whatever a run left behind, and nobody else's processes are touched.

Times are ``time.monotonic()`` seconds (CLOCK_MONOTONIC, system-wide): the simulator's and
the trampoline's stamps, our daemon's ``mono`` log field and the bench's own clock are the
same clock. supervisord logs wall-clock times; ``mono_minus_wall`` converts them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import tomli_w

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
PY = sys.executable  # the project's virtualenv: the daemon, the simulator and the children
TAG_VAR = "SGLANG_BENCH_TAG"
PROPAGATED = ("SGLANG_SUPERVISOR_TEST_ID",)  # the tests' leftover check follows this one
STAMP_EXEC = BENCH / "stamp_exec.py"
FLOOD = BENCH / "flood.py"

T = TypeVar("T")


class BenchError(Exception):
    """A benchmark could not be measured (a process failed, a deadline passed)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """How big one run is; ``quick`` is the CI smoke size."""

    quick: bool
    repeats: int
    work: Path  # a fresh temporary directory, removed at the end
    tag: str

    def dir(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path


# --- rows of the results table ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stat:
    """A figure and its spread: ``value`` is the headline (a median, or a percentile over
    every sample pooled), ``low``/``high`` the range over repeats, ``n`` the sample count."""

    value: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        """Median and range of per-repeat figures."""
        if not values:
            raise BenchError("no samples")
        return cls(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the README table. ``ratio`` is ours / supervisord (lower is better)."""

    key: str
    title: str
    unit: str
    ours: Stat | None
    supervisord: Stat | None = None
    goal: str = ""
    met: bool | None = None
    note: str = ""
    text: str = ""  # a non-numeric figure (e.g. "none imported"), shown instead of ours

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.supervisord is None or self.supervisord.value <= 0:
            return None
        return self.ours.value / self.supervisord.value

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


@dataclass
class Section:
    """What one benchmark returns: its rows and the raw samples behind them."""

    name: str
    rows: list[Row] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# --- statistics ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): always one of the samples."""
    if not values:
        raise BenchError("no samples")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def pooled(per_repeat: Sequence[Sequence[float]], q: float) -> Stat:
    """The ``q`` percentile over every sample of every repeat, with the per-repeat range."""
    every = [v for rep in per_repeat for v in rep]
    each = [percentile(rep, q) for rep in per_repeat if rep]
    return Stat(percentile(every, q), min(each), max(each), len(every))


def ms(ns_or_s: Iterable[float], *, scale: float = 1e3) -> list[float]:
    return [v * scale for v in ns_or_s]


# --- clocks and stamps --------------------------------------------------------------------


def now_ns() -> int:
    return time.monotonic_ns()


def read_stamps(path: Path) -> list[float]:
    """The ``monotonic_ns`` lines of a stamp file, as seconds (a torn last line is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(int(line) / 1e9)
        except ValueError:
            continue
    return out


def mono_minus_wall(samples: int = 9) -> float:
    """``time.monotonic() - time.time()``, the tightest of a few paired readings."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        a = time.monotonic()
        w = time.time()
        b = time.monotonic()
        if best is None or b - a < best[0]:
            best = (b - a, (a + b) / 2 - w)
    assert best is not None
    return best[1]


def follow(stamps: Sequence[float], events: Sequence[float], within_s: float = 30.0) -> list[float]:
    """For each stamp, seconds to the first event after it (stamps with none are dropped)."""
    ordered = sorted(events)
    out = []
    for s in stamps:
        nxt = next((e for e in ordered if e >= s), None)
        if nxt is not None and nxt - s <= within_s:
            out.append(nxt - s)
    return out


# --- processes ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(settings: Settings) -> dict[str, str]:
    """The variables every process of this run carries (the tag, the tests' id), and SGLang's
    crash-diagnostics switches off (the simulator honours them as 0.5.23 does: no 5 s sleep
    and no coredump wait before the tree is killed), for ours and supervisord alike."""
    env = {TAG_VAR: settings.tag, "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
    env.update({k: os.environ[k] for k in PROPAGATED if k in os.environ})
    return env


def tagged(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(TAG_VAR) == tag:
                found.append(p)
        except psutil.Error:
            continue
    return found


def reap_tagged(tag: str) -> list[int]:
    """SIGKILL every live process of this run (there should be none); returns their pids."""
    procs = [p for p in tagged(tag) if _alive(p)]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
    return [p.pid for p in procs]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``predicate`` until truthy; ``BenchError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 30.0, *, group: bool = False) -> int:
    """SIGTERM, wait, SIGKILL if needed (its whole process group with ``group``: it was
    started in a session of its own); always reaps."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
    return proc.wait(10)


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the process's peak resident set since it started (exact, from the kernel)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise BenchError(f"no VmHWM for pid {pid}")


def timed_run(argv: Sequence[str], env: Mapping[str, str] | None = None) -> float:
    """Wall seconds of one command run to its end (output discarded); fails on exit != 0."""
    start = time.monotonic()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False)
    elapsed = time.monotonic() - start
    if done.returncode != 0:
        raise BenchError(f"{argv[0]} exited {done.returncode}: {done.stderr.decode(errors='replace')[-500:]}")
    return elapsed


def trampoline(stamp: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` behind the stamping exec trampoline (no site, isolated: a fast start)."""
    return [PY, "-I", "-S", str(STAMP_EXEC), str(stamp), "--", *argv]


def simulator(*args: str) -> list[str]:
    return [PY, "-m", "supervisor.sim.simulator", *args]


# --- our daemon ---------------------------------------------------------------------------


def write_toml(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write ``sections`` as a TOML file (tomli-w: the one TOML writer of tests and bench)."""
    path.write_text(tomli_w.dumps(sections))
    path.chmod(0o644)
    return path


def daemon_sections(
    settings: Settings,
    work: Path,
    command: Sequence[str],
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """A config for one benchmark run: its own port, state dir and simulated GPUs."""
    from supervisor.sim import simgpu

    gpus = work / "gpus"
    simgpu.ensure_gpus(gpus, 8, 96)
    base: dict[str, dict[str, Any]] = {
        "server": {
            "command": list(command),
            "model_path": "moonshotai/Kimi-K2.5",
            "port": free_port(),
            "tp_size": 1,
            "mem_fraction_static": 0.93,
            "stop_grace_s": 5.0,
            "env": {"SGLANG_SIM_GPU_DIR": str(gpus), **child_env(settings)},
        },
        "health": {"startup_timeout_s": 120.0, "startup_poll_s": 0.1},
        "policy": {"backoff_initial_s": 0.0, "backoff_jitter": 0.0, "max_crashes": 100000},
        "gpu": {"backend": "simulated", "sim_dir": str(gpus), "interval_s": 1.0, "release_timeout_s": 20.0,
                "headroom_action": "warn"},
        "metrics": {"enabled": False},
        "logging": {"format": "json"},
        "state": {"dir": str(work / "state")},
    }
    for section, keys in (overrides or {}).items():
        base.setdefault(section, {}).update(keys)
    return base


def server_argv(config: Path) -> list[str]:
    """The exact argv our daemon launches first (what supervisord is given too)."""
    from supervisor.core.argv import build_argv
    from supervisor.core.config import load_config
    from supervisor.core.state import Learned

    cfg = load_config(config)
    learned = Learned.initial(cfg)
    return list(build_argv(cfg, learned.fraction, learned.hicache_size_gb))


class Daemon:
    """``sglang-supervisor run`` as a subprocess; its JSON log lines read as they come."""

    def __init__(self, settings: Settings, work: Path, sections: Mapping[str, Mapping[str, Any]],
                 python: str = PY) -> None:
        self.work = work
        self.config = write_toml(work / "daemon.toml", sections)
        self.log_path = work / "daemon.log.jsonl"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._events: list[dict[str, Any]] = []
        self._offset = 0
        self.started_ns = now_ns()
        self.proc = subprocess.Popen(
            [python, "-m", "supervisor.cli", "run", "--config", str(self.config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            cwd=work,
            env={**os.environ, **child_env(settings)},
            start_new_session=True,  # its own process group: killed whole if it hangs on stop
        )
        self.pid = self.proc.pid

    @property
    def server_log(self) -> Path:
        return self.work / "state" / "server.log"

    def events(self) -> list[dict[str, Any]]:
        with open(self.log_path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                self._events.append(json.loads(line))
            except ValueError:
                continue
        return self._events

    def monos(self, predicate: Callable[[dict[str, Any]], bool]) -> list[float]:
        return [float(e["mono"]) for e in self.events() if "mono" in e and predicate(e)]

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise BenchError(f"the daemon exited {self.proc.returncode} before {what}: {self.tail()}")
            return next((e for e in self.events() if predicate(e)), None)

        return wait_until(found, timeout, what)

    def tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> int:
        """SIGTERM; a daemon past its own shutdown deadline (and slack) is SIGKILLed with its
        group and the run fails with what it said was pending."""
        try:
            code = stop_process(self.proc, timeout=90.0, group=True)
        finally:
            self._log.close()
        if code == -signal.SIGKILL:
            said = next((line for line in self.tail(20000).splitlines() if "shutdown_overdue" in line), "")
            raise BenchError(f"the daemon did not exit after SIGTERM (SIGKILLed): {said or self.tail()}")
        return code


def state_left(*states: str) -> Callable[[dict[str, Any]], bool]:
    """Matches ``state_changed`` lines leaving one of ``states``."""
    return lambda e: e.get("event") == "state_changed" and e.get("from") in states


def event_is(name: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("event") == name and all(e.get(k) == v for k, v in fields.items())


def interleaved(repeat: int) -> tuple[str, str]:
    """Who goes first in this repeat: ours and supervisord take turns."""
    return ("ours", "supervisord") if repeat % 2 == 0 else ("supervisord", "ours")
