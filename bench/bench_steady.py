"""Steady cost (issue 8, row 4): CPU and peak RSS of the supervisor while nothing happens.

A healthy simulator on 8 simulated GPUs (tp 8; 2 in the quick run) writes 2,000 log lines a
second (its TP0 does, as SGLang's does); our daemon samples the GPUs every second and probes /health every 5 s;
metrics are served as in production. Over a fixed window after the server is ready:
CPU seconds of the supervisor's own process (user + system, children excluded) and its
peak RSS (VmHWM). supervisord supervises the same child, with the same log capture.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .common import (
    Daemon,
    Row,
    Section,
    Settings,
    Stat,
    child_env,
    cpu_seconds,
    daemon_sections,
    event_is,
    free_port,
    interleaved,
    peak_rss_bytes,
    reap_tagged,
    server_argv,
    simulator,
    wait_until,
    write_toml,
)
from .supervisord import Supervisord

LINES_PER_S = 2000
READY = "The server is fired up and ready to roll!"


def _sections(settings: Settings, work: Path, tp: int, kv: bool = False) -> dict[str, dict[str, object]]:
    sim = simulator("--sim-load-s", "0.2", "--sim-log-rate", str(LINES_PER_S))  # TP0 logs, as in SGLang
    return daemon_sections(settings, work, sim, {
        # kv: SGLang's /metrics read with every probe (docs/capacity.md's KV-pressure reading)
        "server": {"tp_size": tp, "extra_args": ["--enable-metrics"] if kv else []},
        "health": {"interval_s": 5.0, "timeout_s": 30.0},
        "gpu": {"interval_s": 1.0},
        "metrics": {"enabled": True, "listen": f"127.0.0.1:{free_port()}"},
    })


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def _window(pid: int, seconds: float, captured: Path) -> tuple[float, float, float]:
    """(% of one core, peak RSS in MB) of ``pid`` over the next ``seconds``, and the lines
    per second its child's log really received meanwhile."""
    lines0, cpu0, t0 = _lines(captured), cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)  # the measurement window itself, not a wait for readiness
    cpu1, t1, lines1 = cpu_seconds(pid), time.monotonic(), _lines(captured)
    return 100 * (cpu1 - cpu0) / (t1 - t0), peak_rss_bytes(pid) / 1e6, (lines1 - lines0) / (t1 - t0)


def _ours(settings: Settings, work: Path, tp: int, seconds: float, kv: bool = False) -> tuple[float, float, float]:
    daemon = Daemon(settings, work, _sections(settings, work, tp, kv))
    try:
        daemon.wait_for(event_is("state_changed", to="READY"), 120, "the server ready")
        return _window(daemon.pid, seconds, daemon.server_log)
    finally:
        daemon.stop()
        reap_tagged(settings.tag)


def _supervisord(settings: Settings, exe: Path, work: Path, tp: int, seconds: float) -> tuple[float, float, float]:
    sections = _sections(settings, work, tp)
    argv = server_argv(write_toml(work / "argv.toml", sections))
    sv = Supervisord(exe, work, argv, {**child_env(settings), **sections["server"]["env"]})
    try:
        wait_until(lambda: READY in sv.child_output(), 120, "the server ready under supervisord", 0.1)
        return _window(sv.pid, seconds, sv.child_log)
    finally:
        sv.stop()
        reap_tagged(settings.tag)


def run(settings: Settings, exe: Path) -> Section:
    tp, seconds = (2, 3.0) if settings.quick else (8, 30.0)
    got: dict[str, list[tuple[float, float, float]]] = {"ours": [], "supervisord": [], "ours_kv": []}
    for r in range(settings.repeats):
        first, second = interleaved(r)
        kv = ("ours_kv",) if os.environ.get("BENCH_STEADY_KV", "1") != "0" else ()  # bench.ab: off
        for who in (first, *kv, second):  # the KV-reading run between the other two
            work = settings.dir(f"steady-{who}-{r}")
            got[who].append(_supervisord(settings, exe, work, tp, seconds) if who == "supervisord"
                            else _ours(settings, work, tp, seconds, kv=who == "ours_kv"))
    cpu = {k: Stat.of([c for c, _, _ in v]) for k, v in got.items() if v}
    rss = {k: Stat.of([m for _, m, _ in v]) for k, v in got.items() if v}
    rate = {k: Stat.of([r for _, _, r in v]).value for k, v in got.items() if v}
    section = Section("steady", raw={"window_s": seconds, "tp": tp, "lines_per_s": LINES_PER_S,
                                     "cpu_percent_rss_mb_lines_per_s": got})
    scene = (f"8 simulated GPUs sampled 1/s, tp {tp}, a probe every 5 s, {LINES_PER_S} lines/s asked "
             f"(received: ours {rate['ours']:,.0f}/s, supervisord {rate['supervisord']:,.0f}/s), "
             f"a {seconds:g} s window, metrics served")
    section.rows += [
        Row("steady_cpu", "steady CPU, % of one core", "%", cpu["ours"], cpu["supervisord"], "≤ 0.5 %",
            cpu["ours"].value <= 0.5, note=scene),
        Row("steady_rss", "steady peak RSS", "MB", rss["ours"], rss["supervisord"], "≤ 50 MB",
            rss["ours"].value <= 50),
    ]
    if got["ours_kv"]:
        # issue 25: reading SGLang's /metrics with each probe must not move the steady CPU beyond
        # the spread of the plain runs
        section.rows.append(Row("steady_cpu_kv", "steady CPU with KV-pressure reading on (--enable-metrics), % of one core", "%",
            cpu["ours_kv"], None, "within the plain runs' spread",
            cpu["ours_kv"].value <= cpu["ours"].high + (cpu["ours"].high - cpu["ours"].low),
            note=f"plain: {cpu['ours'].value:.3f} % ({cpu['ours'].low:.3f}-{cpu['ours'].high:.3f})"))
    return section
