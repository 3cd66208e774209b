"""Hang noticed (issue 8, row 3): the server stops answering; how long until we kill it.

The simulator's ``--sim-fail hang`` stops answering /health (it accepts and never replies)
and writes ``monotonic_ns`` at that moment; the daemon's ``server_stopping`` line (logged
just before it SIGKILLs the group: a hung server gets no grace) is the kill. Compared with
``interval × failures + timeout``, the bound the issue names. supervisord has no health
check: it never notices a hang.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    Daemon,
    Row,
    Section,
    Settings,
    Stat,
    daemon_sections,
    event_is,
    follow,
    read_stamps,
    reap_tagged,
    simulator,
    wait_until,
)

INTERVAL_S, TIMEOUT_S, FAILURES = 0.5, 1.0, 2


def _hangs(settings: Settings, work: Path, count: int) -> list[float]:
    stamps = work / "hang.stamps"
    sim = simulator("--sim-load-s", "0.05", "--sim-fail", "hang", "--sim-fail-after-s", "0.3",
                    "--sim-crash-stamp", str(stamps))
    daemon = Daemon(settings, work, daemon_sections(settings, work, sim, {
        "health": {"interval_s": INTERVAL_S, "timeout_s": TIMEOUT_S, "failures": FAILURES},
    }))
    kills = event_is("server_stopping")
    try:
        wait_until(lambda: len(daemon.monos(kills)) >= count, 30 + 15 * count, f"{count} hangs killed")
    finally:
        daemon.stop()
        reap_tagged(settings.tag)
    return follow(read_stamps(stamps)[:count], daemon.monos(kills))


def run(settings: Settings) -> Section:
    count = 1 if settings.quick else 3
    per_run = [_hangs(settings, settings.dir(f"hang-{r}"), count) for r in range(settings.repeats)]
    every = [v for run in per_run for v in run]
    bound = INTERVAL_S * FAILURES + TIMEOUT_S
    stat = Stat.of(every)
    section = Section("hang", raw={"seconds": per_run, "interval_s": INTERVAL_S, "timeout_s": TIMEOUT_S,
                                   "failures": FAILURES, "bound_s": bound})
    section.rows.append(Row(
        "hang_noticed", f"hang → killed (interval {INTERVAL_S:g} s, timeout {TIMEOUT_S:g} s, {FAILURES} failures)",
        "s", stat, goal=f"≤ {bound:g} s (interval × failures + timeout)", met=stat.value <= bound,
        note="supervisord: never (it has no health check)",
    ))
    return section
