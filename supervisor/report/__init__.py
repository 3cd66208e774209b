"""The morning report (docs/report.md): one page of the night from the state directory.

``collect`` reads each server's journal and GPU memory ring and sums the night up
(``supervisor.core.night``); ``text`` words it for a terminal; ``html`` (``page.py``) and
``png`` draw it with matplotlib (``chart.py``, the ``[report]`` extra). The daemon never
imports this package (import-linter's contract "the daemon never imports the report or
matplotlib", pyproject.toml).
"""

from __future__ import annotations

import socket
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any

from supervisor.core.config import Config, alert_instance, server_configs, unit_name
from supervisor.core.night import Night, summarize
from supervisor.core.site_rules import rule_toml
from supervisor.sinks.alerts import describe
from supervisor.sinks.gpuring import Ring, read_ring
from supervisor.sinks.journal import read_journal

EVENT_ROWS_MAX = 300
TEXT_ROWS_MAX = 40
UNNAMED_MAX = 20  # lines in "Crashes it could not name", the most recent ones


@dataclass(frozen=True, slots=True)
class ServerNight:
    """One server's night: the figures, the GPU ring, what to do now, and the records."""

    name: str
    state_dir: str
    night: Night
    ring: Ring | None
    todo: tuple[str, ...]
    records: tuple[dict[str, Any], ...]


def clock_time(t: float, tz: tzinfo) -> str:
    return datetime.fromtimestamp(t, tz).strftime("%H:%M")


def todo_sentences(night: Night, records: Sequence[dict[str, Any]], *, instance: str, tz: tzinfo) -> tuple[str, ...]:
    """One sentence per open problem, in the MQTT alerts' own wording (``alerts.describe``),
    after the time it was raised."""
    out: list[str] = []
    for kind, record in night.open_problems:
        host = str(record.get("host") or socket.gethostname()).split(".")[0]
        sentence = describe(kind, record, host=host, instance=instance)
        out.append(f"{clock_time(float(record['t']), tz)}: {sentence}")
    return tuple(out)


def collect(cfg: Config, *, since_s: float, now: float, tz: tzinfo) -> list[ServerNight]:
    """Each server's night over the last ``since_s`` seconds before ``now``."""
    nights = []
    units = server_configs(cfg)
    for unit in units:
        records = [r for r in read_journal(unit.state.dir) if r["t"] <= now]
        night = summarize(records, start=now - since_s, end=now, floor=unit.policy.fraction_ladder[-1])
        instance = alert_instance(cfg, unit)
        inside = tuple(r for r in records if r["t"] >= night.start)
        nights.append(ServerNight(
            name=unit_name(unit), state_dir=unit.state.dir, night=night,
            ring=read_ring(unit.state.dir, since=night.start),
            todo=todo_sentences(night, records, instance=instance, tz=tz), records=inside,
        ))
    return nights


# --- words --------------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _fraction(value: float | None) -> str:
    return "SGLang's default" if value is None else f"{value:g}"


def summary_rows(sn: ServerNight) -> list[tuple[str, str]]:
    """The summary table: (what, value)."""
    n = sn.night
    crashes = ", ".join(f"{cause} × {count}" for cause, count in n.crashes) or "none"
    kv = ", ".join(f"{tokens:,} at {fraction:g}" for fraction, tokens in n.kv_tokens_by_rung()) or "not seen"
    avail = ", ".join(
        f"#{launch.attempt} at {_fraction(launch.fraction)}: {launch.avail_mem_after_capture_gb:g} GB"
        for launch in n.launches if launch.avail_mem_after_capture_gb is not None
    ) or "not seen"
    rows = [
        ("state now", n.state),
        ("serving time", f"{n.serving_pct:.1f} % ({duration(n.serving_s)} of {duration(n.supervised_s)} supervised)"),
        ("time lost to crashes", duration(n.lost_crash_s)),
        ("time lost to restarts", duration(n.lost_restart_s)),
        ("crashes by cause", crashes),
        ("mem_fraction_static", f"{_fraction(n.fraction_start)} at the start → {_fraction(n.fraction_end)} at the end"),
        ("KV tokens (max_total_num_tokens) per rung", kv),
        ("avail mem after CUDA-graph capture, per launch", avail),
        ("the ladder's floor", _fraction(n.floor)),
    ]
    if sn.ring is not None and sn.ring.free_mib:
        least = min(min(r) for r in sn.ring.free_mib) / 1024
        last = min(sn.ring.free_mib[-1]) / 1024
        rows.append(("free GPU memory (least rank)", f"{last:.1f} GB now, {least:.1f} GB at the least"))
    return rows


@dataclass(frozen=True, slots=True)
class Unnamed:
    """A line of SGLang's log it could not name (normalised), the crashes that ended on it,
    and the ``[[diagnosis.rule]]`` to paste that teaches it (None: too little text for one)."""

    line: str
    reading: str  # "other", or "cuda_oom_runtime (uncertain)": what it settled on
    times: tuple[float, ...]
    rule: str | None


def unnamed_crashes(records: Sequence[dict[str, Any]]) -> list[Unnamed]:
    """The crashes read as ``other`` or uncertain that kept their first error line
    (``unrecognised``), one entry per line and reading, oldest first; the last ``UNNAMED_MAX``."""
    found: dict[tuple[str, str], list[float]] = {}
    for r in records:
        line = r.get("unrecognised")
        if r.get("kind") != "crash" or not isinstance(line, str) or not line.strip():
            continue
        cause = str(r.get("cause") or "other")
        if cause != "other" and r.get("certain") is not False:
            continue
        reading = cause if cause == "other" else f"{cause} (uncertain)"
        found.setdefault((line.strip(), reading), []).append(float(r["t"]))
    out = [Unnamed(line=line, reading=reading, times=tuple(times), rule=rule_toml(line, reading.split(" ")[0]))
           for (line, reading), times in found.items()]
    return sorted(out, key=lambda u: u.times[0])[-UNNAMED_MAX:]


UNNAMED_HELP = ("If you know what a line means, paste its rule into the config, set the cause, and reload "
                "(systemctl reload): the next crash that prints it is read as that cause (docs/diagnosis.md).")


def unnamed_when(u: Unnamed, tz: tzinfo) -> str:
    times = ", ".join(clock_time(t, tz) for t in u.times[-6:])
    more = f" and {len(u.times) - 6} more" if len(u.times) > 6 else ""
    return f"{times}{more}" + (f" ({len(u.times)} crashes)" if len(u.times) > 1 else "")


def event_line(r: dict[str, Any]) -> str:
    """A journal record in a few words (the events table and the text report)."""
    k, g = str(r.get("kind")), r.get
    if k == "state_changed":
        return f"{g('from')} → {g('to')}: {g('reason')}"
    if k == "launch":
        return f"launch #{g('attempt')} at mem_fraction_static={_fraction(g('mem_fraction_static'))}, pid {g('pid')}"
    if k == "crash":
        ev = (g("evidence") or [""])[0]
        return (f"crash: {g('cause')} ({g('phase')}) at {_fraction(g('mem_fraction_static'))}, remedy {g('remedy')}"
                f" → {_fraction(g('next_mem_fraction_static'))}" + (f"; {str(ev)[:160]}" if ev else ""))
    if k == "restart_scheduled":
        return f"restart in {float(g('delay_s') or 0):.1f} s at mem_fraction_static={_fraction(g('mem_fraction_static'))}"
    if k == "startup_facts":  # what SGLang's log said; a CPU server has no CUDA graphs
        said = [f"{g('avail_mem_after_capture_gb')} GB after CUDA-graph capture"] * (
            g("avail_mem_after_capture_gb") is not None)
        said += [f"max_total_num_tokens={g('max_total_num_tokens')}"] * (g("max_total_num_tokens") is not None)
        return "startup facts: " + (", ".join(said) or "none read")
    if k == "gave_up":
        return f"gave up: {g('reason')}"
    skip = {"t", "ts", "kind", "instance", "host", "server", "ranks", "evidence", "log_evidence"}
    rest = ", ".join(f"{key}={value}" for key, value in r.items() if key not in skip)
    return f"{k}: {rest}"[:240]


NOTABLE = frozenset({"state_changed", "launch", "crash", "restart_scheduled", "startup_facts", "recovered", "gave_up",
                     "headroom_low", "gpu_memory_stuck", "port_in_use", "daemon_started", "daemon_stopping",
                     "daemon_failed", "fraction_learned", "restart_requested", "server_down", "preflight_failed"})


def notable(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") in NOTABLE][-EVENT_ROWS_MAX:]


def text(nights: Sequence[ServerNight], *, tz: tzinfo, title: str) -> str:
    """The report for a terminal."""
    lines = [title, ""]
    for sn in nights:
        n = sn.night
        if len(nights) > 1:
            lines += [f"== server {sn.name} ==", ""]
        lines.append(f"{datetime.fromtimestamp(n.start, tz):%Y-%m-%d %H:%M} – {datetime.fromtimestamp(n.end, tz):%H:%M}"
                     f" ({sn.state_dir})")
        lines.append("")
        lines.append("What to do now:")
        lines += [f"  - {s}" for s in sn.todo] or ["  - nothing: no open problem"]
        lines.append("")
        width = max(len(k) for k, _ in summary_rows(sn))
        lines += [f"  {k:<{width}}  {v}" for k, v in summary_rows(sn)]
        lines.append("")
        unnamed = unnamed_crashes(sn.records)
        if unnamed:
            lines += ["Crashes it could not name:", *textwrap.wrap(UNNAMED_HELP, 100, initial_indent="  ",
                                                                   subsequent_indent="  ")]
            for u in unnamed:
                lines += ["", f"  {unnamed_when(u, tz)}: read as {u.reading}", f"    line: {u.line}"]
                lines += [f"    {rule_line}" for rule_line in (u.rule or "(too little text in it for a rule)").splitlines()]
            lines.append("")
        shown = notable(sn.records)
        lines.append("The night:" if len(shown) <= TEXT_ROWS_MAX else
                     f"The night (its last {TEXT_ROWS_MAX} of {len(shown)} events; the HTML report shows up to {EVENT_ROWS_MAX}):")
        for r in shown[-TEXT_ROWS_MAX:]:
            lines.append(f"  {datetime.fromtimestamp(float(r['t']), tz):%H:%M:%S}  {event_line(r)}")
        lines.append("")
    return "\n".join(lines)
