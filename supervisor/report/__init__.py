"""The morning report (docs/report.md): one page of the night from the state directory.

``collect`` reads each server's journal and GPU memory ring and sums the night up
(``supervisor.core.night``), with what the server ran and its crashes in words
(``crashes.py``); ``text`` words it for a terminal; ``html`` (``page.py``) and
``png`` draw it with matplotlib (``chart.py``, the ``[report]`` extra). The daemon never
imports this package (import-linter's contract "the daemon never imports the report or
matplotlib", pyproject.toml).
"""

from __future__ import annotations

import socket
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any

from supervisor.core.config import Config, alert_instance, server_configs, unit_name
from supervisor.core.diagnosis.site_rules import rule_toml
from supervisor.core.events import Event, from_fields
from supervisor.core.model import Cause
from supervisor.core.night import Advice, ClimbStep, KvPressure, Night, summarize
from supervisor.report.crashes import CrashRow, crash_columns, crash_rows, header_rows, zone_label
from supervisor.sinks.alerts import describe
from supervisor.sinks.gpuring import Ring, read_ring
from supervisor.sinks.journal import clip, read_journal

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
    about: tuple[tuple[str, str], ...] = ()  # the SGLang version, the GPUs, the launch command
    crashes: tuple[CrashRow, ...] = ()


def clock_time(t: float, tz: tzinfo) -> str:
    return datetime.fromtimestamp(t, tz).strftime("%H:%M")


def todo_sentences(night: Night, records: Sequence[dict[str, Any]], *, instance: str, tz: tzinfo) -> tuple[str, ...]:
    """One sentence per open problem, in the MQTT alerts' own wording (``alerts.describe``),
    after the time it was raised."""
    out: list[str] = []
    for kind, record in night.open_problems:
        host = str(record.get("host") or socket.gethostname()).split(".")[0]
        event = record_event(record)
        sentence = (describe(event, host=host, instance=instance) if event is not None
                    else f"sglang {instance} on {host}: {kind}")  # describe's own words for what it cannot read
        out.append(f"{clock_time(float(record['t']), tz)}: {sentence}")
    return tuple(out)


def record_event(record: Mapping[str, Any]) -> Event | None:
    """The typed event a journal record was written from (``sinks.journal.journal_line``: its
    fields with ``t``, ``ts`` and ``kind``); None for one this version cannot read back (cut
    short, or written by another version)."""
    fields = {k: v for k, v in record.items() if k not in ("t", "ts", "kind")}
    try:
        return from_fields(str(record.get("kind")), fields)
    except (ValueError, TypeError, KeyError):
        return None


def collect(cfg: Config, *, since_s: float, now: float, tz: tzinfo) -> list[ServerNight]:
    """Each server's night over the last ``since_s`` seconds before ``now``."""
    nights = []
    units = server_configs(cfg)
    for unit in units:
        records = [r for r in read_journal(unit.state.dir) if r["t"] <= now]
        night = summarize(records, start=now - since_s, end=now, floor=unit.policy.fraction_ladder[-1])
        instance = alert_instance(cfg, unit)
        inside = tuple(r for r in records if r["t"] >= night.start)
        ring = read_ring(unit.state.dir, since=night.start)
        nights.append(ServerNight(
            name=unit_name(unit), state_dir=unit.state.dir, night=night, ring=ring,
            todo=todo_sentences(night, records, instance=instance, tz=tz), records=inside,
            about=tuple(header_rows(records, ring)), crashes=tuple(crash_rows(unit_name(unit), inside, tz)),
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


# --- what to change: the recommended fraction, KV pressure, climbs (issue 25) ---------------


def _when(t: float, night: Night, tz: tzinfo) -> str:
    """HH:MM, with the date when it is from before the night."""
    return clock_time(t, tz) if t >= night.start else datetime.fromtimestamp(t, tz).strftime("%Y-%m-%d %H:%M")


def _pct(share: float) -> str:
    return f"{share * 100:+.0f} %"


def recommended_sentence(advice: Advice, night: Night, tz: tzinfo) -> str:
    """The memory model's last word on the fraction: what to set and its arithmetic (the
    record's ``words``), or what it still needs before it can say."""
    said = f" (the memory model, {_when(advice.t, night, tz)})"
    if advice.fraction is None:
        missing = advice.missing or advice.words.removeprefix("no recommended fraction yet: ") or "more launches"
        return f"No recommended mem_fraction_static yet: {missing}{said}."
    words = advice.words
    if not words:  # a record without its words: from the figures
        gain = f" would give {_pct(advice.gain)} KV tokens and" if advice.gain is not None else ""
        room = f"{advice.headroom_gb:.1f} GB" if advice.headroom_gb is not None else "the headroom"
        words = f"{advice.fraction:g}{gain} leave {room} at the observed peak on the tightest rank ({advice.rank or '?'})"
    if advice.direction == "keep" and " leave " in words:  # "+0 % KV tokens" says nothing
        sentence = f"keep {advice.fraction:g}: it leaves {words.split(' leave ', 1)[1]}"
    else:
        lead = {"raise": f"raise it to {advice.fraction:g}", "lower": f"lower it to {advice.fraction:g}",
                "keep": f"keep {advice.fraction:g}"}.get(advice.direction, f"{advice.fraction:g}")
        sentence = f"{lead}. {words[:1].upper()}{words[1:]}"
    stale = ""
    if advice.current is not None and night.fraction_end is not None and abs(advice.current - night.fraction_end) > 1e-9:
        stale = f" It was said at {advice.current:g}; the server runs {night.fraction_end:g} now."
    return f"Recommended mem_fraction_static: {sentence}{said}.{stale}"


def kv_pressure_sentence(kv: KvPressure, night: Night, tz: tzinfo) -> str:
    """How often SGLang's KV pool ran short, by source, the last time and at which fraction."""
    plural = "s" if kv.signals != 1 else ""
    sources = ", ".join(f"{n} {source}" for source, n in kv.by_source)
    at = f" at {kv.last_fraction:g}" if kv.last_fraction is not None else ""
    detail = f" ({kv.last_source}: {kv.last_detail})" if kv.last_detail else f" ({kv.last_source})"
    return (f"KV pressure: {kv.signals} signal{plural} ({sources}), the last at {_when(kv.last_t, night, tz)}{at}"
            f"{detail}. Not a crash: SGLang's KV cache ran short while serving (requests retracted or queued), "
            "the sign that a higher fraction would pay.")


def _cause(cause: str | None) -> str:
    if cause is None:
        return "an unknown error"
    try:
        return Cause.parse(cause).summary
    except ValueError:
        return cause


def climb_sentence(c: ClimbStep, night: Night, tz: tzinfo) -> str:
    """A climb, its fall-back or its keeping, in a few words."""
    when = _when(c.t, night, tz)
    to = "?" if c.fraction is None else f"{c.fraction:g}"
    if c.kind == "climb":
        frm = f" (from {c.before:g})" if c.before is not None else ""
        gain = f": {_pct(c.gain)} KV tokens" if c.gain is not None else ""
        return f"raised to {to} at {when}{frm}{gain}"
    if c.kind == "fell_back":
        failed = "?" if c.before is None else f"{c.before:g}"
        return f"fell back to {to} at {when}: {failed} failed on probation ({_cause(c.cause)})"
    probation = f"its {duration(c.probation_s)} probation" if c.probation_s is not None else "its probation"
    return f"kept {to} at {when}, after {probation}"


def fraction_lines(night: Night, tz: tzinfo) -> tuple[list[str], list[str]]:
    """(the recommendation and the KV pressure, one sentence each; the climbs, one line
    each): what the report says about the fraction to run at. Empty when the daemon said
    nothing of it."""
    said = []
    if night.recommended is not None:
        said.append(recommended_sentence(night.recommended, night, tz))
    if night.kv_pressure is not None:
        said.append(kv_pressure_sentence(night.kv_pressure, night, tz))
    return said, [climb_sentence(c, night, tz) for c in night.climbs]


FRACTION_HEADING = "What to change"


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

    def w(key: str) -> object:  # a value to print: never None
        value = r.get(key)
        return "unknown" if value is None or value == "" else value

    if k == "state_changed":
        return f"{w('from')} → {w('to')}: {w('reason')}"
    if k == "launch":
        return f"launch #{w('attempt')} at mem_fraction_static={_fraction(g('mem_fraction_static'))}, pid {w('pid')}"
    if k == "crash":
        ev = (g("evidence") or [""])[0]
        nxt = g("next_mem_fraction_static")
        then = (f"next at {_fraction(nxt)}" if g("next_retry_s") is not None else "no relaunch")
        return (f"crash: {w('cause')} ({w('phase')}) at {_fraction(g('mem_fraction_static'))}, {then}"
                + (f"; {clip(str(ev), 160)}" if ev else ""))
    if k == "restart_scheduled":
        return f"restart in {float(g('delay_s') or 0):.1f} s at mem_fraction_static={_fraction(g('mem_fraction_static'))}"
    if k == "startup_facts":  # what SGLang's log said; a CPU server has no CUDA graphs
        said = [f"{w('avail_mem_after_capture_gb')} GB after CUDA-graph capture"] * (
            g("avail_mem_after_capture_gb") is not None)
        said += [f"max_total_num_tokens={w('max_total_num_tokens')}"] * (g("max_total_num_tokens") is not None)
        return "startup facts: " + (", ".join(said) or "none read")
    if k == "gave_up":
        return f"gave up: {w('reason')}"
    if k == "recommended_fraction":
        if g("fraction") is None:
            return f"recommended fraction: none yet, the memory model {g('missing') or 'needs more launches'}"
        return f"recommended fraction: {w('words')}"
    if k == "kv_pressure":
        return clip(f"KV pressure ({w('source')}): {w('signals')} signal(s) at mem_fraction_static="
                    f"{_fraction(g('mem_fraction_static'))}; {w('detail') or 'no detail'}", 240)
    if k == "climb":
        gain = g("kv_tokens_gain")
        more = f": {_pct(gain)} KV tokens" if isinstance(gain, int | float) else ""
        return f"climb: {_fraction(g('mem_fraction_before'))} → {_fraction(g('mem_fraction_static'))}{more}"
    if k == "climb_fell_back":
        return (f"climb fell back to {_fraction(g('mem_fraction_static'))}: {_fraction(g('mem_fraction_failed'))} "
                f"failed on probation ({w('cause')})")
    if k == "climb_kept":
        return (f"climb kept: {_fraction(g('mem_fraction_static'))} served through its "
                f"{duration(float(g('probation_s') or 0))} probation")
    skip = {"t", "ts", "kind", "instance", "host", "server", "ranks", "evidence", "log_evidence", "argv", "gpus"}
    rest = ", ".join(f"{key.replace('_', ' ')} {_said(value)}" for key, value in r.items()
                     if key not in skip and value not in (None, "", [], {}))
    return clip(f"{k.replace('_', ' ')}: {rest}" if rest else k.replace("_", " "), 240)


def _said(value: object) -> str:
    """A field's value in a line: a list or a table without JSON's brackets and nulls."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return "; ".join(_said(v) for v in value if v is not None) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_said(v)}" for k, v in value.items() if v is not None) or "none"
    return str(value)


NOTABLE = frozenset({"state_changed", "launch", "crash", "restart_scheduled", "startup_facts", "recovered", "gave_up",
                     "headroom_low", "gpu_memory_stuck", "port_in_use", "daemon_started", "daemon_stopping",
                     "daemon_failed", "fraction_learned", "restart_requested", "server_down", "preflight_failed",
                     "recommended_fraction", "kv_pressure", "climb", "climb_fell_back", "climb_kept"})


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
                     f" {zone_label(tz, n.end)} ({sn.state_dir})")
        width = max((len(k) for k, _ in sn.about), default=0)
        for k, v in sn.about:
            lines += textwrap.wrap(v, 100, initial_indent=f"{k:<{width}}  ", subsequent_indent=" " * (width + 2),
                                   break_long_words=False, break_on_hyphens=False)
        lines.append("")
        lines.append("What to do now:")
        lines += [f"  - {s}" for s in sn.todo] or ["  - nothing: no open problem"]
        lines.append("")
        said, climbed = fraction_lines(n, tz)
        if said or climbed:
            lines.append(f"{FRACTION_HEADING}:")
            for sentence in said:
                lines += textwrap.wrap(sentence, 100, initial_indent="  - ", subsequent_indent="    ")
            if climbed:
                lines.append("  - climbs:")
                lines += [f"      {c}" for c in climbed]
            lines.append("")
        width = max(len(k) for k, _ in summary_rows(sn))
        lines += [f"  {k:<{width}}  {v}" for k, v in summary_rows(sn)]
        lines.append("")
        if sn.crashes:
            lines += crash_text(sn.crashes, tz)
        unnamed = unnamed_crashes(sn.records)
        if unnamed:
            lines += ["Crashes it could not name:", *textwrap.wrap(UNNAMED_HELP, 100, initial_indent="  ",
                                                                   subsequent_indent="  ")]
            for u in unnamed:
                lines += ["", f"  {unnamed_when(u, tz)}: read as {u.reading}", f"    line: {u.line}"]
                lines += [f"    {rule_line}" for rule_line in (u.rule or "(too little text in it for a rule)").splitlines()]
            lines.append("")
        shown = notable(sn.records)
        zone = f" (times {zone_label(tz, n.end)})"
        lines.append(f"The night{zone}:" if len(shown) <= TEXT_ROWS_MAX else
                     f"The night{zone}, its last {TEXT_ROWS_MAX} of {len(shown)} events (the HTML report shows up to "
                     f"{EVENT_ROWS_MAX}):")
        for r in shown[-TEXT_ROWS_MAX:]:
            lines += textwrap.wrap(event_line(r), 110, initial_indent=f"  {datetime.fromtimestamp(float(r['t']), tz):%H:%M:%S}  ",
                                   subsequent_indent=" " * 12, break_long_words=False, break_on_hyphens=False)
        lines.append("")
    return "\n".join(lines)


def crash_text(rows: Sequence[CrashRow], tz: tzinfo) -> list[str]:
    """The crash table for a terminal: a block per crash, each cell wrapped at spaces (never
    inside a word), its column's name before it."""
    names = crash_columns(tz, rows[-1].t)
    width = max(len(name) for name in names)
    lines = [f"Crashes ({len(rows)}):"]
    for row in rows:
        lines.append("")
        for name, cell in zip(names, row.cells(), strict=True):
            lines += textwrap.wrap(cell, 104, initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4),
                                   break_long_words=False, break_on_hyphens=False)
    lines.append("")
    return lines
