"""Render the chaos matrix's and the soak's JSON-lines results as docs/reliability.md.

    python -m tests.chaos.report RESULTS.jsonl [-o docs/reliability.md]

The tests append one line per trial (``"kind": "trial"``) and one per soak run (``"kind":
"soak"``) to the file named by CHAOS_RESULTS; this turns them into the tables of the
issue: fault, trials, handled as promised, time to recover (p50/max), events lost, and the
soak's resource figures, with the command that reproduces them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

COMMAND = "make chaos"
COMMAND_EXPANDED = (
    "CHAOS_TRIALS=20 SOAK_CYCLES=1000 CHAOS_RESULTS=.chaos/results.jsonl "
    ".venv/bin/python -m pytest -q -ra -m chaos tests/chaos && "
    ".venv/bin/python -m tests.chaos.report .chaos/results.jsonl -o docs/reliability.md"
)


def load(path: Path) -> list[dict[str, Any]]:
    """The records of a results file (lines that are not JSON are skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _seconds(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


def _sum(records: Iterable[dict[str, Any]], key: str) -> int:
    return sum(int(r.get(key) or 0) for r in records)


def matrix_table(trials: list[dict[str, Any]]) -> list[str]:
    """One row per fault, in the order the faults first appear."""
    faults: dict[str, list[dict[str, Any]]] = {}
    for r in trials:
        faults.setdefault(r["fault"], []).append(r)
    rows = [
        "| fault | side | what the policy promises | trials | handled as promised | "
        "time to recover p50 / max (s) | measured from | alerts logged | events lost | "
        "duplicates | orphans | max servers at once |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for rs in faults.values():
        first = rs[0]
        ok = sum(1 for r in rs if r["ok"])
        recover = [float(r["recover_s"]) for r in rs if r["ok"] and r.get("recover_s") is not None]
        servers = max((int(r.get("max_servers") or 0) for r in rs), default=0)
        rows.append(
            f"| {first['title']} | {first['side']} | {first['promise']} | {len(rs)} | {ok}/{len(rs)} | "
            f"{_seconds(recover)} | {first['recover_from']} | {_sum(rs, 'alerts_logged')} | "
            f"{_sum(rs, 'alerts_lost')} | {_sum(rs, 'alert_duplicates')} | {_sum(rs, 'orphans')} | {servers} |"
        )
    return rows


def extras(trials: list[dict[str, Any]]) -> list[str]:
    """Per-fault side measurements: numbers as p50/max, counters summed, the rest listed."""
    lines = []
    by_fault: dict[str, list[dict[str, Any]]] = {}
    for r in trials:
        if r.get("extra"):
            by_fault.setdefault(r["fault"], []).append(r["extra"])
    for name, items in by_fault.items():
        numeric: dict[str, list[float]] = {}
        counters: dict[str, dict[str, int]] = {}
        other: dict[str, set[str]] = {}
        for extra in items:
            for k, v in extra.items():
                if isinstance(v, dict):
                    total = counters.setdefault(k, {})
                    for sub, n in v.items():
                        total[sub] = total.get(sub, 0) + int(n)
                elif isinstance(v, bool) or not isinstance(v, int | float):
                    other.setdefault(k, set()).add(json.dumps(v, sort_keys=True))
                else:
                    numeric.setdefault(k, []).append(float(v))
        parts = [f"{k} p50 {statistics.median(v):g}, max {max(v):g}" for k, v in numeric.items()]
        parts += [f"{k} summed over {len(items)} trials: {json.dumps(v, sort_keys=True) if v else 'none'}"
                  for k, v in counters.items()]
        parts += [f"{k}: {', '.join(sorted(v))}" for k, v in other.items()]
        lines.append(f"- `{name}`: " + "; ".join(parts))
    return lines


def failures(trials: list[dict[str, Any]]) -> list[str]:
    """Failed trials grouped by fault and first line of the error."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r in trials:
        if not r["ok"]:
            first = re.sub(r"/\S+?(?=[\s:'\"]|$)", "PATH", ((r.get("error") or "").splitlines() or [""])[0])[:300]
            groups.setdefault((r["fault"], first), []).append(int(r["trial"]))
    if not groups:
        return ["None: every fault was handled as promised in every trial."]
    return [f"- `{fault}`, {len(idx)} trial(s) ({', '.join(map(str, sorted(idx)))}): {error}"
            for (fault, error), idx in groups.items()]


def stops_section(trials: list[dict[str, Any]], ends: list[dict[str, Any]]) -> list[str]:
    """Every stop ended by itself, and how long it took; what the run left behind."""
    stops = [float(r["extra"]["stop_s"]) for r in trials if isinstance(r.get("extra", {}).get("stop_s"), int | float)]
    hung = [r for r in trials if "did not exit" in str(r.get("error") or "") or "shutdown_overdue" in str(r.get("error") or "")]
    lines = [
        f"**A stop always ends.** {len(stops)} daemon stops by SIGTERM at the end of the trials "
        f"(p50 / max {_seconds(stops)} s, each within its shutdown deadline of stop_grace_s + 15 s, "
        "`supervisor/daemon.py`); "
        f"{len(hung)} hung (a daemon still there at its deadline plus slack is SIGKILLed with its "
        "process group, and the trial fails with its `shutdown_overdue` line).",
    ]
    if ends:
        left = sum(int(e.get("leftovers") or 0) for e in ends)
        lines += ["", f"Processes left alive at the end of the run (the suite's own end-of-run check, "
                      f"`tests/leftovers.py`): {left}."]
    return lines


def soak_section(soaks: list[dict[str, Any]]) -> list[str]:
    if not soaks:
        return ["No soak run in these results."]
    s = soaks[-1]

    def row(label: str, key: str, scale: float = 1.0, fmt: str = "{:.0f}", percent: bool = False) -> str:
        a, b, c = (s[p][key] / scale for p in ("start", "mid", "end"))
        change = (f"{(c - a) / a * 100:+.1f} %" if a else "-") if percent else f"{c - a:+.0f}"
        return f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {fmt.format(c)} | {change} |"

    return [
        f"{s['cycles']} crash -> restart cycles in one daemon in {s['duration_s']:.0f} s "
        f"({s['crashes']} crashes, {s['ready']} times serving again). Each figure is the daemon's "
        f"peak over a window of {s['window_cycles']} cycles (after {s['warmup_cycles']} warm-up cycles), "
        "read from /proc/PID/{fd,status}.",
        "",
        "| daemon resource | start | middle | end | end vs start |",
        "|---|---:|---:|---:|---:|",
        row("open file descriptors", "fds"),
        row("threads", "threads"),
        row("RSS (MiB)", "rss_kb", 1024.0, "{:.1f}", percent=True),
        "",
        f"Zombies at the end: {s['zombies']}. Orphans at the end: {s['orphans']}. "
        f"Servers at once, at most: {s['max_servers']}. Alerts logged: {s['alerts_logged']}, "
        f"lost: {s['alerts_lost']}, duplicates: {s['alert_duplicates']}. "
        "Asyncio tasks are not counted: the daemon does not report them (yet).",
    ]


def render(records: list[dict[str, Any]], *, source: str) -> str:
    trials = [r for r in records if r.get("kind") == "trial"]
    soaks = [r for r in records if r.get("kind") == "soak"]
    per_fault = max((r["trial"] + 1 for r in trials), default=0)
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    lines = [
        "# Reliability: chaos matrix and soak",
        "",
        f"Generated on {now} by `python -m tests.chaos.report {source}` from a full run; do not edit",
        "the tables by hand. To reproduce:",
        "",
        "```sh",
        COMMAND,
        "# which is:",
        COMMAND_EXPANDED,
        "```",
        "",
        f"Machine: {platform.system()} {platform.release()}, {os.cpu_count()} CPUs shared with other",
        f"work, Python {platform.python_version()}. No GPU and no SGLang: the simulator",
        "(`supervisor/sim/simulator.py`) plays both, with a real mosquitto for the alerts. Times are",
        "this noisy machine's, with the test config's compressed timings (probe every 0.3 s, 2",
        "failures = a hang, backoff 0.2 s): they show that recovery happens and in what order of",
        "magnitude, not what a 600 GB model takes.",
        "",
        "## Chaos matrix",
        "",
        f"{len(trials)} trials: each fault x {per_fault}. Every trial also checks that the daemon",
        "stops with exit 0, every alert it logged reached the broker (by id; `events lost` counts",
        "the missing ones), there were never two servers on the port, and no process of the trial",
        "is left running or as a zombie (`orphans`).",
        "",
        *matrix_table(trials),
        "",
        *stops_section(trials, [r for r in records if r.get("kind") == "run_end"]),
        "",
        "How each fault is made is in its function in `tests/chaos/test_chaos_matrix.py`. Two need",
        "a word: the wall clock cannot be moved here without privileges, so",
        "`tests/chaos/clockjump/sitecustomize.py` shifts `time.time()` and `datetime.now()` by",
        "+1 day, -1 h, +10 min and -2 days in turn every 0.7 s inside the daemon and the simulator",
        "(monotonic time untouched); a full state or log directory is a 256 KiB tmpfs filled to",
        "ENOSPC (without mount rights: the state directory replaced by a file, the log on /dev/full).",
        "",
        "Side measurements per fault (all trials):",
        "",
        *extras(trials),
        "",
        "Failed trials:",
        "",
        *failures(trials),
        "",
        "## Soak",
        "",
        *soak_section(soaks),
        "",
        "## Fuzzing and security",
        "",
        "In the normal suite (`make test`): `tests/test_fuzz_config.py` (random TOML keys, types,",
        "values and encodings: exit 2 and one line, never a traceback), `tests/test_fuzz_logs.py`",
        "(random bytes and giant lines through the daemon's output path: a diagnosis, never an",
        "exception), `tests/test_fuzz_health.py` (garbage, trickles, huge bodies, endless headers:",
        "a failed probe within its timeout), `tests/test_fuzz_alerts.py` (huge evidence: a bounded",
        "payload), `tests/test_security.py` (loopback binds, no shell, config and password file",
        "modes, no secret in any log, the server's environment).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.report", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="the JSON-lines file CHAOS_RESULTS named")
    p.add_argument("-o", "--output", type=Path, default=None, help="write here (default: stdout)")
    args = p.parse_args(argv)
    try:
        records = load(args.results)
    except OSError as exc:
        print(f"report: cannot read {args.results}: {exc.strerror}", file=sys.stderr)
        return 2
    text = render(records, source=str(args.results))
    if args.output is None:
        sys.stdout.write(text)
    else:
        # the real night's section (tests/real/soak_report.py) is not ours to drop
        from tests.real.soak_report import kept_section

        kept = kept_section(args.output.read_text(encoding="utf-8")) if args.output.exists() else ""
        args.output.write_text(text + ("\n" + kept if kept else ""), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
