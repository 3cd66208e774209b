"""``python -m bench.bench_real [--kills N]``: the daemon owning a real SGLang 0.5.23 on the CPU.

Needs ``make real-sglang``. Measures, on one daemon per setting of SGLang's crash-diagnostics
switches (its defaults, which sleep 5 s before the tree is killed, and both switched off):

- a scheduler SIGKILLed from outside -> the daemon's EXITED (noticed), its ``server_down``
  alert, the relaunch's exec, READY again; and, side by side, when SGLang's main process
  exited: the moment a daemon that watches only the main process (ours before issue 12)
  would have noticed;
- a planned restart (``sglang-supervisor restart``) with 4 requests in flight: time to
  READY and failed requests;
- the daemon's CPU (share of one core) and RSS while SGLang serves a steady client load.

Writes ``bench/results-real.json`` and prints a Markdown table (the README's real section).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the tests' harness imports its conftest

from tests.harness import DaemonRun  # noqa: E402
from tests.real import nights  # noqa: E402
from tests.real.sglang_env import load  # noqa: E402

LOCK = "/tmp/real-sglang.lock"


def _mono_of(event: dict[str, Any]) -> float:
    return nights._ts(event)


def _watch_exit(pid: int, out: dict[str, float]) -> threading.Thread:
    """Polls every millisecond for ``pid``'s end: when a main-process watcher would know."""
    def run() -> None:
        try:
            p = psutil.Process(pid)
        except psutil.Error:
            return
        while True:
            try:
                if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:
                break
            time.sleep(0.001)
        out["main_exit"] = time.time()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _crash(d: DaemonRun, attempt: int) -> dict[str, float]:
    pid = int(d.wait_for("launch", attempt=attempt, timeout=60)["pid"])
    d.wait_for("server_ready", count=attempt, timeout=240)
    sched = nights.part(pid)
    seen: dict[str, float] = {}
    watcher = _watch_exit(pid, seen)
    t0 = time.time()
    os.kill(sched.pid, signal.SIGKILL)
    exited = d.wait_for("state_changed", to="EXITED", count=attempt, timeout=60)
    down = d.wait_for("server_down", count=attempt, timeout=60)
    launch = d.wait_for("launch", attempt=attempt + 1, timeout=120)
    ready = d.wait_for("server_ready", count=attempt + 1, timeout=240)
    watcher.join(60)
    return {
        "noticed_s": _mono_of(exited) - t0,
        "down_alert_s": _mono_of(down) - t0,
        "main_exit_s": seen.get("main_exit", float("nan")) - t0,
        "relaunch_s": _mono_of(launch) - t0,
        "ready_s": _mono_of(ready) - t0,
    }


def _restart(config: Path, port: int) -> dict[str, float]:
    load_ = nights.Requests(port)
    time.sleep(0.7)
    t0 = time.time()
    rc = subprocess.call([sys.executable, "-m", "supervisor.cli", "restart", "--config", str(config)],
                         cwd=REPO, stdout=subprocess.DEVNULL)
    took = time.time() - t0
    load_.join()
    return {"restart_ready_s": took, "restart_failed": float(load_.failed), "restart_rc": float(rc)}


def _steady(d: DaemonRun, port: int, seconds: float) -> dict[str, float]:
    """Daemon CPU (share of one core) and RSS while a client keeps 2 requests in flight."""
    proc = psutil.Process(d.proc.pid)
    stop = threading.Event()
    served = [0]

    def client() -> None:
        while not stop.is_set():
            nights.Requests(port, n=1, tokens=256).join(60)
            served[0] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    c0, w0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    c1, w1 = sum(proc.cpu_times()[:2]), time.monotonic()
    rss = proc.memory_info().rss
    stop.set()
    for t in threads:
        t.join(60)
    return {"daemon_cpu_pct": 100.0 * (c1 - c0) / (w1 - w0), "daemon_rss_mb": rss / 2**20,
            "requests_served": float(served[0])}


def run_setting(real: Any, tmp: Path, *, diagnostics: bool, kills: int, steady_s: float) -> dict[str, Any]:
    env = dict(real.env)
    if diagnostics:  # SGLang's defaults: py-spy dump and CUDA coredump waits before the tree dies
        env.pop("SGLANG_PYSPY_DUMP_BEFORE_CRASH", None)
        env.pop("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", None)
    config = nights.write_config(tmp, [*real.command(), *real.extra_args], model=real.model, env=env,
                                 name="diag" if diagnostics else "nodiag")
    port = int(nights.config_of(config)["server"]["port"])
    crashes = []
    with DaemonRun(config) as d:
        d.wait_for("server_ready", timeout=240)
        for i in range(kills):
            crashes.append(_crash(d, i + 1))
        extra = _restart(config, port)
        extra.update(_steady(d, port, steady_s))
        assert d.stop(timeout=120) == 0
    return {"crashes": crashes, **extra}


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(results: dict[str, Any]) -> str:
    lines = ["| setting | SIGKILL -> noticed | -> main process exited (a main-only watcher) | -> down alert | "
             "-> relaunch exec | -> READY | planned restart -> READY | failed requests (restart, 4 in flight) | "
             "daemon CPU while serving | daemon RSS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["settings"].items():
        c = r["crashes"]
        lines.append(
            f"| {name} | {1000 * _median(c, 'noticed_s'):.0f} ms | {_median(c, 'main_exit_s'):.2f} s | "
            f"{1000 * _median(c, 'down_alert_s'):.0f} ms | {_median(c, 'relaunch_s'):.2f} s | {_median(c, 'ready_s'):.1f} s | "
            f"{r['restart_ready_s']:.1f} s | {int(r['restart_failed'])} | {r['daemon_cpu_pct']:.2f} % | {r['daemon_rss_mb']:.0f} MB |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_real", description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3, help="scheduler kills per setting (medians are reported)")
    p.add_argument("--steady-s", type=float, default=30.0, help="seconds of steady load for the CPU figure")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results-real.json")
    args = p.parse_args()
    real = load()
    import fcntl

    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "command": "python -m bench.bench_real " + " ".join(sys.argv[1:]),
                               "sglang": real.version, "kills": args.kills, "settings": {}}
    with open(LOCK, "a") as lock, tempfile.TemporaryDirectory(prefix="sgl-real-bench-") as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name, diagnostics in (("SGLang defaults (5 s diagnostics sleep)", True),
                                  ("diagnostics off (SGLANG_*_BEFORE_CRASH=0)", False)):
            sub = Path(tmp) / ("diag" if diagnostics else "nodiag")
            sub.mkdir()
            print(f"bench_real: {name} ...", file=sys.stderr, flush=True)
            results["settings"][name] = run_setting(real, sub, diagnostics=diagnostics, kills=args.kills,
                                                    steady_s=args.steady_s)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
