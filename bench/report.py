"""The results table: ``results.json`` rendered as markdown between the README's markers.

One row per measurement: ours (headline and range over repeats), supervisord's where it
applies, the ratio, the goal and whether it is met. Row notes become numbered footnotes;
a missed goal gets the reason measured when profiling it (``WHY_MISSED``).
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

START, END = "<!-- bench:start -->", "<!-- bench:end -->"

# Why a goal is missed, as measured (profiled) on this box; shown only while it is missed.
_NOTICE = (
    "the daemon adds to the floor (a parent blocked in `waitpid()`, see the note) what lies "
    "between a part's pidfd turning readable and `state_changed`: the loop's wake-up, the core's "
    "step, the state file's write and rename (its fsync runs on a flusher thread since issue 36: "
    "it was 0.4-2.3 ms of it) and the JSON line; on 2 shared cores the p99 follows the machine's "
    "load more than the daemon."
)
_PUMP = (
    "measured on the pump alone (80 MB pre-formatted): before issue 36 the search for the two "
    "retraction words was 40 of its 92 ms; each word is now searched only from where its rarest "
    "byte (`_`) first appears, and a read is kept from the one read buffer without a copy. What is "
    "left is the log write and the tail's copy (`cat` does neither), and on 2 shared cores the "
    "daemon's own probes and GPU samples in the same loop."
)
_RSS = (
    "imports, mostly, measured by part in a production venv on 2026-12-05: the interpreter 8.6 MB, "
    "asyncio with the OpenSSL its `ssl` loads 10.7 MB, prometheus_client with the stdlib HTTP, email "
    "and wsgiref modules its `__init__` imports 4.4 MB, structlog 2.2 MB, psutil 0.9 MB, h11 0.3 MB, "
    "the supervisor's own modules about 7 MB (205 frozen dataclasses' generated methods 2.3 MB of it); "
    "then the catalogue's word index 1.9 MB and the servers' output tails."
)
WHY_MISSED: dict[str, str] = {
    "crash_noticed_p50": _NOTICE,
    "crash_noticed_p99": _NOTICE,
    "hang_noticed": (
        "a probe starts every `interval_s`; the kill comes when the `failures`-th failed probe "
        "times out, so the bound is met only when the hang starts just before a probe."
    ),
    "crash_diagnosed_p99": (
        "each diagnosis reads from the catalogue file the rows its lines bring up (~600 for the "
        "simulator's OOM, 7.5 ms of diagnosis on 2 AMD EPYC cores), and none is kept for the next "
        "(issue 36: kept, they were the real soak's RSS growth); the word index (35-50 ms) loads in "
        "a thread at the daemon's first launch, and a crash during that load waits for it."
    ),
    "steady_cpu": (
        "profiled by parts on 2026-12-06 02:30 (py-spy, and each part switched off for 30 s "
        "windows): the idle daemon (no GPU sampling, no log) 0.23 %, a probe's round (HTTP, the "
        "core's step, its event) ~2.9 ms of it every 5 s; GPU sampling and the pump's 10 reads a "
        "second add 0.05-0.15 % each. The same idle daemon then read 0.23, 0.80 and 0.57 % within "
        "ten minutes with nothing changed, and supervisord 5.7 % and 8.5 % in two runs of this "
        "row six hours apart: on this shared VM the absolute 0.5 % is inside what one run's "
        "noise moves. A longer poll pause (`BATCH_S`) would cut the pump's part, at the price "
        "of the 1 MiB pipe covering less than 10 MB/s when a burst follows the trickle."
    ),
    "logs_format": _PUMP,
    "logs_format_vs_cat": _PUMP,
    "logs_raw": _PUMP,
    "logs_raw_vs_cat": _PUMP,
    "relaunch_p50": "clearing the GPUs walks every process on the host (`cleanup.find_stale`).",
    "steady_rss": (
        "this row is the daemon in the test venv, where structlog also loads rich; the `rss_*` rows "
        "are a production install. What a serving daemon holds is imports, mostly: see those rows."
    ),
    "rss_serving": _RSS,
    "rss_after_crashes": _RSS,
}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _stat(stat: dict[str, Any] | None, unit: str) -> str:
    if stat is None:
        return "—"
    u = "" if unit in ("", "×") else f" {unit}"
    head = f"{_num(stat['value'])}{'×' if unit == '×' else ''}{u}"
    if stat["n"] > 1 and stat["low"] != stat["high"]:
        head += f" ({_num(stat['low'])}–{_num(stat['high'])})"
    return head


def _met(met: bool | None) -> str:
    return "—" if met is None else ("yes" if met else "**no**")


def table(results: dict[str, Any]) -> str:
    """The README section: machine, date, command, the table and its notes."""
    m = results["machine"]
    out = [
        f"Measured {results['date']} with `{results['command']}` on {m['cpus']} × {m['cpu']}, "
        f"{m['memory_gb']} GB, Linux {m['kernel']}, Python {m['python']} "
        f"(load average at start {', '.join(map(str, m['loadavg_at_start']))}; the machine is shared, "
        f"so read the ratios, measured side by side in the same run). supervisord {results['supervisord']}. "
        f"Figures: median (or the percentile named, over every sample) and, in brackets, the range "
        f"over {results['repeats']} interleaved repeats.",
        "",
        "| measurement | ours | supervisord | ours ÷ supervisord | goal | met? |",
        "|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    missed: dict[str, list[str]] = {}  # reason -> the rows it explains
    for row in results["rows"]:
        title = row["title"]
        if row.get("note"):
            if row["note"] not in notes:
                notes.append(row["note"])
            title += f" [{notes.index(row['note']) + 1}]"
        ours = row["text"] or _stat(row["ours"], row["unit"])
        ratio = "—" if row["ratio"] is None else f"{_num(row['ratio'])}"
        out.append(f"| {title} | {ours} | {_stat(row['supervisord'], row['unit'])} | {ratio} | "
                   f"{row['goal'] or '—'} | {_met(row['met'])} |")
        if row["met"] is False and row["key"] in WHY_MISSED:
            missed.setdefault(WHY_MISSED[row["key"]], []).append(row["title"])
    out.append("")
    out += [f"[{i}] {n}  " for i, n in enumerate(notes, 1)]
    out += [f"{n}  " for n in results.get("notes", [])]
    if missed:
        out += ["", "Goals missed, and why (profiled):", ""]
        out += [f"- **{'; '.join(titles)}**: {why}" for why, titles in missed.items()]
    if results.get("errors"):
        out += ["", "Not measured in this run: " + "; ".join(f"{k}: {v}" for k, v in results["errors"].items())]
    return "\n".join(out).rstrip() + "\n"


def update_readme(readme: Path, body: str) -> None:
    """Replace what lies between the bench markers (nothing else in the file changes)."""
    text = readme.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{readme}: no {START} ... {END} markers")
    readme.write_text(pattern.sub(lambda _m: f"{START}\n{body}{END}", text, count=1))
