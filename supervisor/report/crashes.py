"""The report's crash table and header, in words for the person reading them.

``crash_rows`` turns each ``crash`` record (``core.machine.crash.crash_event``) into a row:
when (local time, its zone in the column's name), the server, the rank, the cause, where
(``file:line function``, the innermost frame outside torch), the log's line whole, and what
the daemon did next (``fraction 0.93 → 0.88, relaunched in 2.1 s``), read from the record's
``next_*`` fields and the launch or give-up that followed it. ``header_rows`` says what the
server ran: the SGLang version, the GPUs and the launch command, from the last ``launch``
record (its ``sglang_version``, ``gpus`` and redacted ``argv``) and the GPU ring. Nothing here
prints a raw ``None`` or a field's name: a missing value is said in words.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any

from supervisor.core.model import Cause
from supervisor.sinks.gpuring import Ring

NONE = "—"  # a cell with nothing to say
CRASH_COLUMNS = ("time", "server", "rank", "cause", "where (file:line function)", "the log's line", "what it did next")


def zone_label(tz: tzinfo, t: float) -> str:
    """The zone the report's times are in: its abbreviation at ``t`` ("CET", "UTC"), with the
    IANA name when it says more ("Europe/Berlin, CET")."""
    abbreviation = datetime.fromtimestamp(t, tz).strftime("%Z") or "local time"
    key = getattr(tz, "key", None)
    named = isinstance(key, str) and "/" in key.strip("/") and not key.startswith("/") and key != abbreviation
    return f"{key}, {abbreviation}" if named else abbreviation  # not "localtime, UTC"


def seconds(s: float) -> str:
    """A short wait in words: "0 s", "2.1 s", "45 s", "3 min", "1.5 h"."""
    s = max(float(s), 0.0)
    if s < 10:
        return f"{s:.1f} s".replace(".0 s", " s")
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


@dataclass(frozen=True, slots=True)
class CrashRow:
    t: float
    time: str
    server: str
    rank: str
    cause: str
    location: str
    evidence: str
    remedy: str

    def cells(self) -> tuple[str, ...]:
        return (self.time, self.server, self.rank, self.cause, self.location, self.evidence, self.remedy)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def cause_words(record: Mapping[str, Any]) -> str:
    """"a CUDA OOM while serving (cuda_oom_runtime, OutOfMemoryError)": the cause in words,
    its name (what the docs and the alerts call it) and the exception, when known."""
    name = str(record.get("cause") or "other")
    try:
        summary = Cause.parse(name).summary
    except ValueError:
        summary = name
    said = [name] + ([str(record["exc_type"])] if record.get("exc_type") else [])
    uncertain = ", uncertain" if record.get("certain") is False else ""
    return f"{summary} ({', '.join(said)}{uncertain})"


def evidence_words(record: Mapping[str, Any]) -> str:
    """The log's line that named the cause, whole, with its line number in the server log."""
    lines = [str(x) for x in record.get("evidence") or () if str(x).strip()]
    if not lines:
        return "(no line in the server's log)"
    lineno = record.get("evidence_lineno")
    return (f"line {lineno}: " if isinstance(lineno, int) else "") + lines[0].strip()


def remedy_words(record: Mapping[str, Any], after: Sequence[Mapping[str, Any]]) -> str:
    """What the daemon did after this crash, in words: the fraction's step, the hierarchical
    cache's, and the relaunch (when it came, from the next ``launch`` record) or the give-up.
    ``after``: the records that followed it."""
    t = float(record["t"])
    nxt = next((r for r in after if r.get("kind") in ("launch", "gave_up", "crash")), None)
    retry = _number(record.get("next_retry_s"))
    if retry is None:  # no relaunch of its own: it gave up, or a group's leader decides
        if nxt is not None and nxt.get("kind") == "gave_up":
            return f"gave up: {nxt.get('reason') or 'a restart cannot fix it'}"
        return "no relaunch by this daemon (gave up, or the group's leader decides)"
    said = []
    before, to = _number(record.get("mem_fraction_static")), _number(record.get("next_mem_fraction_static"))
    if to is None:
        said.append("SGLang's default fraction")
    elif before is None:
        said.append(f"fraction {to:g} (from SGLang's default)")
    elif abs(before - to) < 1e-9:
        said.append(f"same fraction {to:g}")
    else:
        said.append(f"fraction {before:g} → {to:g}")
    cache, cache_to = _number(record.get("hicache_size_gb")), _number(record.get("next_hicache_size_gb"))
    if cache is not None and cache_to is not None and abs(cache - cache_to) > 1e-9:
        said.append(f"hierarchical cache {cache:g} → {cache_to:g} GB" if cache_to > 0 else "hierarchical cache off")
    if nxt is not None and nxt.get("kind") == "launch":
        said.append(f"relaunched in {seconds(float(nxt['t']) - t)}")
    elif nxt is not None and nxt.get("kind") == "gave_up":
        said.append(f"then gave up: {nxt.get('reason') or 'no reason recorded'}")
    else:
        said.append(f"relaunch planned in {seconds(retry)}")
    return ", ".join(said)


def crash_rows(server: str, records: Sequence[Mapping[str, Any]], tz: tzinfo) -> list[CrashRow]:
    """One row per ``crash`` record, oldest first (``records``: the server's, in time order)."""
    rows = []
    for k, r in enumerate(records):
        if r.get("kind") != "crash":
            continue
        t = float(r["t"])
        rows.append(CrashRow(
            t=t, time=datetime.fromtimestamp(t, tz).strftime("%H:%M:%S"), server=server,
            rank=str(r.get("rank") or NONE), cause=cause_words(r), location=str(r.get("location") or NONE),
            evidence=evidence_words(r), remedy=remedy_words(r, records[k + 1:]),
        ))
    return rows


def crash_columns(tz: tzinfo, t: float) -> tuple[str, ...]:
    return (f"time ({zone_label(tz, t)})", *CRASH_COLUMNS[1:])


def gpu_words(names: Sequence[str], ring: Ring | None) -> str:
    """"8 × NVIDIA H200 (140 GB each)": the launch's GPUs by name, else the ring's count."""
    total = f" ({ring.total_mib[0] / 1024:.0f} GB each)" if ring is not None and ring.total_mib and len(
        set(ring.total_mib)) == 1 else ""
    if names:
        return ", ".join(f"{n} × {name}" for name, n in Counter(names).items()) + total
    if ring is not None and ring.indices:
        return f"{len(ring.indices)} GPU{'s' if len(ring.indices) != 1 else ''}{total}, model not recorded"
    return "not recorded (no GPU seen: a CPU server, or the GPU probe failed)"


def header_rows(records: Sequence[Mapping[str, Any]], ring: Ring | None) -> list[tuple[str, str]]:
    """What the server ran, from its last launch: (what, value)."""
    launch = next((r for r in reversed(records) if r.get("kind") == "launch"), None)
    if launch is None:
        return [("SGLang", "not recorded (no launch in the journal)"), ("GPUs", gpu_words((), ring)),
                ("launch command", "not recorded (no launch in the journal)")]
    version = str(launch.get("sglang_version") or "")
    names = [str(g) for g in launch.get("gpus") or () if str(g).strip()]
    argv = [str(a) for a in launch.get("argv") or ()]
    return [
        ("SGLang", version or "not recorded (its version could not be read)"),
        ("GPUs", gpu_words(names, ring)),
        ("launch command", shlex.join(argv) if argv else "not recorded (a journal from before it kept the command)"),
    ]
