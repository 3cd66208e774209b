"""The morning report's cost to the daemon (issue 17): steady CPU and peak RSS with the
journal and the GPU memory ring off ([report] enabled = false: the daemon as it was) and on,
measured side by side, interleaved, in bench_steady's scene (8 simulated GPUs sampled every
second, a probe every 5 s, 2,000 log lines a second, metrics served).

The ring is measured at its worst rate, one record a second (``gpu_sample_s = 1``, the
demo's), not the default one a minute. A micro-measurement adds what one sink call costs,
times how often it comes, because a 0.05 %-of-a-core budget is below what two 30 s windows
on a shared machine can tell apart.

    python -m bench.bench_report_cost [--window 30] [--repeats 3] [--before-tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from .bench_steady import _sections, _window
from .common import Daemon, Settings, event_is, reap_tagged


def _run(settings: Settings, work: Path, on: bool, seconds: float, tree: str | None = None) -> tuple[float, float]:
    """One daemon: this tree with [report] on or off, or (``tree``) another checkout's package
    (the commit before the report, which has no [report] section)."""
    sections = _sections(settings, work, 8)
    if tree is None:
        sections["report"] = {"enabled": on, "gpu_sample_s": 1.0, "keep_days": 7.0}
    old_path = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = tree
    try:
        daemon = Daemon(settings, work, sections)
    finally:
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
    try:
        daemon.wait_for(event_is("state_changed", to="READY"), 120, "the server ready")
        cpu, rss, _rate = _window(daemon.pid, seconds, daemon.server_log)
        if on:
            assert (work / "state" / "gpu_ring.bin").exists() and (work / "state" / "journal.jsonl").exists()
        return cpu, rss
    finally:
        daemon.stop()
        reap_tagged(settings.tag)


def micro(tmp: Path) -> dict[str, float]:
    """Microseconds per call of each sink, on this machine."""
    from supervisor.core import events as ev
    from supervisor.sinks.gpuring import GpuRingSink
    from supervisor.sinks.journal import JournalSink

    gpus = tuple({"index": i, "uuid": f"GPU-{i}", "total_bytes": 96 << 30, "free_bytes": (5 << 30) + i,
                  "used_bytes": 91 << 30} for i in range(8))
    sample = ev.GpuSample(gpus=gpus)
    t = [0.0]

    def clock() -> float:
        t[0] += 1.0
        return t[0]

    ring = GpuRingSink(tmp / "ring", sample_s=1.0, keep_days=7.0, clock=clock)
    journal = JournalSink(tmp / "journal")
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        ring.emit(sample)  # a record written on every call: the worst case
    ring_us = (time.perf_counter() - start) / n * 1e6
    changed = ev.StateChanged(from_=ev.State.STARTING, to=ev.State.READY, reason="ready", mem_fraction_static=0.93,
                              hicache_size_gb=None, restarts=0, last_cause=None)
    start = time.perf_counter()
    for _ in range(n):
        journal.emit(changed)
    journal_us = (time.perf_counter() - start) / n * 1e6
    return {"ring_record_us": round(ring_us, 2), "journal_line_us": round(journal_us, 2)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_report_cost")
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before-tree", default=None, metavar="DIR",
                   help="compare with the package in DIR (e.g. `git archive COMMIT supervisor | tar -x -C DIR`) "
                        "instead of this tree with [report] enabled = false")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        settings = Settings(quick=False, repeats=args.repeats, work=Path(tmp), tag=f"bench-{uuid.uuid4().hex[:8]}")
        got: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        for r in range(args.repeats):
            for who in (("off", "on") if r % 2 == 0 else ("on", "off")):
                tree = args.before_tree if who == "off" else None
                got[who].append(_run(settings, settings.dir(f"{who}-{r}"), who == "on", args.window, tree))
        costs = micro(Path(tmp))
    out = {
        "window_s": args.window, "repeats": args.repeats,
        "off": f"the package in {args.before_tree}" if args.before_tree else "this tree, [report] enabled = false",
        "cpu_percent": {k: [round(c, 3) for c, _ in v] for k, v in got.items()},
        "peak_rss_mb": {k: [round(m, 2) for _, m in v] for k, v in got.items()},
        "median_cpu_percent": {k: round(statistics.median(c for c, _ in v), 3) for k, v in got.items()},
        "median_peak_rss_mb": {k: round(statistics.median(m for _, m in v), 2) for k, v in got.items()},
        **costs,
        # At gpu_sample_s = 1 the ring sink sees one gpu_sample a second ([gpu] interval_s = 1) and writes a record each.
        "ring_cpu_percent_at_1_per_s": round(costs["ring_record_us"] / 1e6 * 100, 5),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
