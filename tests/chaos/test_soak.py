"""The soak: SOAK_CYCLES crash -> restart cycles of the fast simulator in one daemon.

The server exits 0.75 s after it is ready (``--sim-fail exit0``, long enough for a probe to
see it serve even on a busy machine: a probe is a round trip through the simulator's
scheduler process, and with the tiers on two pytest-xdist workers beside other work 0.25 s
let 2 of 30 crashes come before the daemon saw the server ready; no backoff, an endless
crash budget), so the daemon runs its whole path over
and over: launch, probe, ready, crash, diagnose, decide, persist, alert (real mosquitto),
clear, preflight. A cycle is one crash. Open fds, threads and RSS of the
daemon are read from /proc at the start, the middle and the end (each the peak over a
window of cycles, so the phase of the cycle at the moment of the sample does not matter);
at the end no zombie, no orphan, and every alert delivered. The normal suite runs 30
cycles; ``make chaos`` runs 1,000 and records the figures for docs/reliability.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import chaoslib
import psutil
import pytest
from chaoslib import LogFollower, record_result, tally_alerts
from conftest import free_port, wait_until
from harness import DaemonRun, ProcessWatch, write_config

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

broker = chaoslib.broker  # the module's fixtures: one mosquitto, one subscriber
subscriber = chaoslib.subscriber
SOAK_CYCLES = int(os.environ.get("SOAK_CYCLES", "30"))
WARMUP = max(3, SOAK_CYCLES // 20)  # cycles before the "start" sample: imports, executor threads
WINDOW = max(3, SOAK_CYCLES // 20)  # cycles each sample window spans


def resources(pid: int) -> dict[str, int]:
    """Open fds, threads, RSS (KiB) and zombie children of ``pid``, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    zombies = 0
    for child in psutil.Process(pid).children():
        try:
            zombies += child.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            continue
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
        "rss_kb": int(fields["VmRSS"].split()[0]),
        "zombies": zombies,
    }


def window_peak(samples: list[dict[str, Any]], first: int, last: int) -> dict[str, int]:
    """The peak of each figure over the samples taken in cycles ``first..last``."""
    chosen = [s for s in samples if first <= s["cycle"] <= last] or samples[-1:]
    return {k: max(s[k] for s in chosen) for k in ("fds", "threads", "rss_kb")}


@pytest.mark.timeout(180 + SOAK_CYCLES * 6)
def test_soak_crash_restart_cycles_keep_resources_flat(tmp_path: Path, broker: Any, subscriber: Any) -> None:
    """A thousand crash -> restart cycles leave fds, threads and RSS flat, no zombie, no
    orphan, never two servers, and lose no alert."""
    instance = f"soak-{os.getpid()}"
    cfg = write_config(
        tmp_path,
        {
            "server": {"tp_size": 1},
            "health": {"startup_poll_s": 0.05},
            "policy": {"backoff_initial_s": 0.0, "max_crashes": 10**9},
            "metrics": {"enabled": True, "listen": f"127.0.0.1:{free_port()}"},
            "mqtt": {"enabled": True, "host": broker.host, "port": broker.port, "topic_prefix": "chaos",
                     "instance": instance, "reconnect_initial_s": 0.2, "reconnect_max_s": 1.0},
        },
        sim_args=("--sim-fail", "exit0", "--sim-fail-after-s", "0.75", "--sim-load-s", "0.02"),
    )
    port = int(next(line.split("=")[1] for line in cfg.read_text().splitlines() if line.startswith("port =")))
    watch = ProcessWatch(port, gpu_dir=tmp_path / "gpus", interval=0.2)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    d = DaemonRun(cfg)
    watch.add_root(d.proc.pid)
    log = LogFollower(d.log_path)
    cycles = 0
    try:
        deadline = started + 120 + SOAK_CYCLES * 5
        while cycles < SOAK_CYCLES:
            assert d.proc.poll() is None, f"the daemon died: {d.log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"only {cycles} of {SOAK_CYCLES} cycles in time"
            cycles += sum(1 for e in log.poll() if e.get("event") == "crash")
            if cycles >= WARMUP:
                samples.append({"cycle": cycles, **resources(d.proc.pid)})
            time.sleep(0.2)
        wait_until(lambda: resources(d.proc.pid)["zombies"] == 0, timeout=10, what="no zombie child")
        assert d.stop() == 0
    finally:
        d.kill()
        servers = watch.close()
    log.poll()
    elapsed = time.monotonic() - started
    start = window_peak(samples, WARMUP, WARMUP + WINDOW)
    mid = window_peak(samples, SOAK_CYCLES // 2, SOAK_CYCLES // 2 + WINDOW)
    end = window_peak(samples, SOAK_CYCLES - WINDOW, SOAK_CYCLES)
    wait_until(lambda: not watch.leftovers(), timeout=15, what="no leftover process")
    tally = tally_alerts(log.events, subscriber, instance, timeout=60)
    bad = [e["event"] for e in log.events if e.get("event") in ("task_failed", "prepare_failed", "gave_up")]
    ready = sum(1 for e in log.events if e.get("event") == "server_ready")
    record_result({
        "kind": "soak", "cycles": cycles, "duration_s": round(elapsed, 1),
        "start": start, "mid": mid, "end": end, "warmup_cycles": WARMUP, "window_cycles": WINDOW,
        "zombies": 0, "orphans": len(watch.leftovers()), "max_servers": servers,
        "alerts_logged": tally.logged, "alerts_lost": tally.lost, "alert_duplicates": tally.duplicates,
        "crashes": sum(1 for e in log.events if e.get("event") == "crash"), "ready": ready, "bad_events": bad,
        "samples": samples[:: max(1, len(samples) // 50)],
    })
    assert servers <= 1
    assert not bad, bad
    assert ready >= cycles - 1  # every cycle served before it crashed
    assert tally.lost == 0, f"{tally.lost} of {tally.logged} alerts lost"
    # Flat: no fd or thread that every cycle leaves behind, memory within a few percent.
    assert end["fds"] <= start["fds"] + 2, (start, mid, end)
    assert end["threads"] <= max(start["threads"], mid["threads"]) + 1, (start, mid, end)
    assert end["rss_kb"] <= mid["rss_kb"] * 1.05 + 4096, (start, mid, end)
