"""``python -m bench.cpu_real [--before REV] [--seconds S] [--rounds N]``: the daemon's CPU
while a real SGLang 0.5.23 serves on the CPU, two trees side by side.

Two daemons run at once, each owning a real server with SGLang's defaults: one from this
checkout ("after"), one from ``REV`` checked out into a temporary worktree ("before", default
``HEAD``: the last commit, against the working tree's changes). Each server gets the same
steady client load (2 requests in flight, 256 tokens each); each daemon's CPU (user +
system, share of one core) and RSS are read over the same windows. The machine's load falls
on both alike, so the ratio is the figure; the absolute shares move with it.

Needs ``make real-sglang``. Holds the host-wide real-SGLang lock. Writes
``bench/results-cpu-real.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
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


def _config(real: Any, tmp: Path, name: str) -> tuple[Path, int]:
    env = dict(real.env)
    env.pop("SGLANG_PYSPY_DUMP_BEFORE_CRASH", None)  # SGLang's defaults
    env.pop("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", None)
    sub = tmp / name
    sub.mkdir()
    config = nights.write_config(sub, [*real.command(), *real.extra_args], model=real.model, env=env, name=name)
    return config, int(nights.config_of(config)["server"]["port"])


def _load(port: int, stop: threading.Event) -> list[threading.Thread]:
    def client() -> None:
        while not stop.is_set():
            nights.Requests(port, n=1, tokens=256).join(60)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    return threads


def _cpu(proc: psutil.Process) -> float:
    return float(sum(proc.cpu_times()[:2]))


def measure(before: str, seconds: float, rounds: int) -> dict[str, Any]:
    real = load()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.cpu_real " + " ".join(sys.argv[1:]), "sglang": real.version,
        "before": subprocess.run(["git", "rev-parse", "--short", before], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.strip(),
        "seconds": seconds, "rounds": [],
    }
    with open(LOCK, "a") as lock, tempfile.TemporaryDirectory(prefix="sgl-cpu-real-") as tmp_name:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tmp = Path(tmp_name)
        tree = tmp / "before-tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), before], cwd=REPO, check=True,
                       capture_output=True)
        stop = threading.Event()
        try:
            cfg_a, port_a = _config(real, tmp, "after")
            cfg_b, port_b = _config(real, tmp, "before")
            with DaemonRun(cfg_a) as after, DaemonRun(cfg_b, tree=tree) as old:
                for d in (after, old):
                    d.wait_for("server_ready", timeout=600)
                threads = _load(port_a, stop) + _load(port_b, stop)
                time.sleep(5.0)
                procs = {"after": psutil.Process(after.proc.pid), "before": psutil.Process(old.proc.pid)}
                for _ in range(rounds):
                    c0 = {k: _cpu(p) for k, p in procs.items()}
                    w0 = time.monotonic()
                    time.sleep(seconds)
                    wall = time.monotonic() - w0
                    row = {f"{k}_cpu_pct": 100.0 * (_cpu(p) - c0[k]) / wall for k, p in procs.items()}
                    row.update({f"{k}_rss_mb": p.memory_info().rss / 2**20 for k, p in procs.items()})
                    results["rounds"].append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                stop.set()
                for t in threads:
                    t.join(60)
                for d in (after, old):
                    d.stop(timeout=120)
        finally:
            stop.set()
            with contextlib.suppress(subprocess.SubprocessError):
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True,
                               timeout=60)
    return results


def table(results: dict[str, Any]) -> str:
    rows = results["rounds"]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def span(key: str) -> str:
        return f"{min(r[key] for r in rows):.2f}–{max(r[key] for r in rows):.2f}"

    return "\n".join([
        f"| daemon | CPU while serving, % of one core (median of {len(rows)} × {results['seconds']:g} s; range) | RSS |",
        "|---|---|---|",
        f"| before ({results['before']}) | {med('before_cpu_pct'):.2f} % ({span('before_cpu_pct')}) | "
        f"{med('before_rss_mb'):.1f} MB |",
        f"| after (this tree) | {med('after_cpu_pct'):.2f} % ({span('after_cpu_pct')}) | {med('after_rss_mb'):.1f} MB |",
        f"| after ÷ before | {med('after_cpu_pct') / med('before_cpu_pct'):.2f} | |",
    ])


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_real", description=__doc__.splitlines()[0])
    p.add_argument("--before", default="HEAD", help="the revision to compare with (default HEAD)")
    p.add_argument("--seconds", type=float, default=60.0, help="seconds per window")
    p.add_argument("--rounds", type=int, default=5, help="windows")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results-cpu-real.json")
    args = p.parse_args()
    results = measure(args.before, args.seconds, args.rounds)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
