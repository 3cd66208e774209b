"""Renders ``make soak-real``'s results (tests/real/soak_real.py's JSON) as a section of
docs/reliability.md.

    python -m tests.real.soak_report .soak/results.json              # the section, on stdout
    python -m tests.real.soak_report .soak/results.json -o docs/reliability.md

With ``-o`` the section replaces the one between ``START`` and ``END`` in that file (or is
appended once); ``python -m tests.chaos.report`` keeps it when it regenerates the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

START = "<!-- soak-real:start -->"
END = "<!-- soak-real:end -->"

WHAT = {
    "sigkill_scheduler": "SIGKILL of a scheduler",
    "sigkill_main": "SIGKILL of a main process",
    "sigkill_detokenizer": "SIGKILL of a detokenizer",
    "sigstop_scheduler": "SIGSTOP of a scheduler (a hang)",
    "rolling_restart": "`sglang-supervisor restart` (rolling)",
    "sighup_flag": "SIGHUP with a changed flag",
    "router_restart": "the router killed and started again",
    "broker_stop": "the broker stopped for 20 s",
    "daemon_kill": "the daemon SIGKILLed, started again",
    "state_unwritable": "the state directory unwritable for 10 s",
    "foreign_server": "a foreign SGLang started on a spare port",
}


# The chaos matrix's faults (tests/chaos/test_chaos_matrix.py, on the simulator) and where each
# runs against the real server, or why it cannot here.
ON_THE_REAL_SERVER = (
    ("runtime CUDA OOM", "simulator only here: a CPU SGLang has no CUDA allocator (a real one needs the GPU "
     "machine, not lent to this task)"),
    ("startup CUDA OOM (graph capture)", "simulator only here: no CUDA graphs on the CPU (same)"),
    ("KV-pool startup error", "real: `test_real_daemon.py::test_kv_pool_failure_raises_the_fraction_past_sglangs_minimum`"),
    ("host OOM", "real: `test_real_oom.py` (a kernel OOM kill in a memory cgroup) and "
     "`test_real_daemon.py::test_sigkilled_scheduler_with_a_cgroup_oom_kill_record_is_host_oom`"),
    ("hang (health stops answering)", "real: `test_real_daemon.py::test_hang_is_quit_killed_and_relaunched_keeping_the_log`; "
     "the soak's SIGSTOP of a scheduler"),
    ("SIGSTOP of the whole server", "real: the soak's SIGSTOP of a scheduler (the hang the rest of the tree waits on)"),
    ("exit 0 nobody asked for", "real: `test_real_chaos.py` (SGLang's main process told to stop from outside, not by the daemon)"),
    ("segfault", "real: `test_real_chaos.py` (SIGSEGV to a scheduler)"),
    ("orphan scheduler holding GPU memory", "simulator only: GPU memory"),
    ("GPU memory that never frees", "simulator only: NVML"),
    ("port taken by a foreign process", "real: `test_real_daemon.py::test_a_foreign_server_on_our_port_is_reported_and_never_killed`; "
     "the soak's foreign SGLang"),
    ("slow start past startup_timeout_s", "real: `test_real_chaos.py` (a start-up timeout shorter than the model's load)"),
    ("MQTT broker down and flapping", "real: the soak's broker stopped for 20 s"),
    ("100 concurrent metrics scrapes during a crash", "simulator only: the daemon's side, the server plays no part"),
    ("NVML errors mid-run", "simulator only: no NVML on the CPU"),
    ("state directory full (or unwritable)", "real: the soak's state directory unwritable for 10 s"),
    ("log directory full", "simulator only: the daemon's side (its log file), the server plays no part"),
    ("daemon SIGKILLed mid-startup / mid-stop", "real: `test_real_chaos.py`; while serving, the soak's daemon SIGKILLed and "
     "started again, and `test_real_group.py` (a daemon of a group dies)"),
    ("daemon SIGKILLed mid-backoff", "simulator only: no server runs during a backoff (the state file is the whole story)"),
    ("wall-clock jump", "simulator only: the daemon's clock; the server plays no part"),
)


def real_cases() -> list[str]:
    lines = ["", "### The chaos matrix's faults on the real server", "",
             "The chaos matrix runs on the simulator. Where each of its faults runs against the real "
             "server: in the real tier of `make test`, one trial each (`CHAOS_TRIALS=N` repeats "
             "`tests/real/test_real_chaos.py`), and in the soak, drawn at random:", "",
             "| chaos fault | on the real server |", "|---|---|"]
    lines += [f"| {fault} | {where} |" for fault, where in ON_THE_REAL_SERVER]
    return lines


def _s(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f}"


def _med(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def render(r: dict[str, Any]) -> str:
    q, a, d, fo = r["requests"], r["alerts"], r["daemon"], r["foreign"]
    lines = [
        START,
        "## A real night, compressed (`make soak-real`)",
        "",
        f"Generated from `{r.get('command', 'make soak-real')}` ({r['started']}) by "
        "`python -m tests.real.soak_report`; do not edit by hand. Two real SGLang "
        f"{r['sglang']} servers on the CPU (the tiny bf16 model) owned by one daemon behind the real "
        "`sglang-router`, a real mosquitto with a subscriber, `[report]` on; two clients send `/generate` "
        "through the router the whole time; every 45-90 s one fault (seeded), never before the last one "
        f"recovered. {r['night_s'] / 60:.1f} minutes of night on {r['machine']}.",
        "",
        "A request's failure belongs to the fault whose window (injection to serving again, plus 3 s) it "
        "overlaps. \"Serving again\": the servers the fault took down READY again and both listed by the router.",
        "",
        "| fault | injected | to serving again, median / max (s) | requests in its windows | failed |",
        "|---|---:|---:|---:|---:|",
    ]
    by: dict[str, list[dict[str, Any]]] = {}
    for f in r["faults"]:
        by.setdefault(f["kind"], []).append(f)
    for kind, fs in sorted(by.items(), key=lambda kv: list(WHAT).index(kv[0]) if kv[0] in WHAT else 99):
        times = [f["to_serving_s"] for f in fs if f["to_serving_s"] is not None]
        never = len(fs) - len(times)
        t = "-" if kind == "foreign_server" else (
            f"{_s(_med(times))} / {_s(max(times) if times else None)}" + (f" ({never} never)" if never else ""))
        failed = sum(f["failed"] for f in fs)
        away = sum(f.get("failed_router_away", 0) for f in fs)
        cell = (f"**{failed}**" if failed else "0") + (f" ({away} while the router was away)" if away else "")
        lines.append(f"| {WHAT.get(kind, kind)} | {len(fs)} | {t} | {sum(f['requests_in_window'] for f in fs)} | "
                     + cell + " |")
    lines += [
        "",
        f"Requests: {q['ok']:,} ok, {q['failed']:,} failed: {q['failed_in_hang_windows']} within a hang's window, "
        f"{q.get('failed_router_away', 0)} while the router was away (killed, until the daemon's next reconcile "
        f"put the servers back in), {q['failed_in_other_windows']} within another fault's window, "
        f"{q['unattributed']} outside every window.",
        "",
        f"Alerts: {a['logged']} logged by the daemon, {a['received']} received by the subscriber (distinct ids); "
        f"**{a['lost']} lost, {a['duplicates']} duplicated** by id.",
        "",
        f"Processes left at the end: {len(r['leftovers'])}"
        + (" (" + "; ".join(f"`{x}`" for x in r["leftovers"][:5]) + ")" if r["leftovers"] else "")
        + ". The foreign SGLang "
        + (f"(pid {fo['pid']}, {fo['processes_seen']} processes): "
           + ("untouched (every process alive at the end, none killed by the daemon), then reaped by the harness."
              if fo.get("untouched") else f"**touched**: {json.dumps(fo)}")
           if fo.get("started") else "was not started (the night was too short)."),
        "",
        "| daemon | start | end | change |",
        "|---|---:|---:|---:|",
    ]
    s, e = d["start"], d["end"]
    for key, name in (("fds", "open file descriptors"), ("threads", "threads")):
        lines.append(f"| {name} | {s.get(key)} | {e.get(key)} | {e.get(key, 0) - s.get(key, 0):+d} |")
    pct = d.get("rss_change_pct")
    lines.append(f"| RSS (MiB) | {s.get('rss_kb', 0) / 1024:.1f} | {e.get('rss_kb', 0) / 1024:.1f} | "
                 + (f"{pct:+.1f} %" if pct is not None else "-") + " |")
    warm, wpct = d.get("rss_warm_base") or {}, d.get("rss_warm_change_pct")
    if warm:
        lines.append(f"| RSS (MiB), from the warm sample | {warm.get('rss_kb', 0) / 1024:.1f} | "
                     f"{e.get('rss_kb', 0) / 1024:.1f} | " + (f"{wpct:+.1f} %" if wpct is not None else "-") + " |")
        lines += ["", "The first crash a daemon diagnoses loads SGLang's message catalogue "
                  "(`supervisor/core/diagnosis/catalogue.py`: its word index, about 4 MB, once): the warm sample is the "
                  "daemon's first 10 s after it (the last daemon's, when it was started again). Each server's "
                  "output tail, kept for the diagnosis, is a bounded buffer that fills at the servers' log rate "
                  "(~0.15 MB a minute here): the night runs with `[logging] tail_bytes` at 256 KiB instead of "
                  "2 MiB, so that it is full early and the RSS compared is what grows without a bound."]
    if len(d.get("incarnations", [])) > 1:
        lines += ["", f"The daemon was SIGKILLed and started again {len(d['incarnations']) - 1} time(s): "
                  "\"start\" is the first daemon's, \"end\" the last one's."]
    failures = Counter()
    for f in r["faults"]:
        for err, n in f["failures"]:
            failures[(f["kind"], err)] += n
    if failures:
        lines += ["", "Failed requests by fault and error:", ""]
        lines += [f"- {WHAT.get(k, k)}: {n} x `{err}`" for (k, err), n in failures.most_common(10)]
    lines += ["", "Each fault in order:", "", "| # | fault | at (s) | server | to serving again (s) | failed |",
              "|---:|---|---:|---|---:|---:|"]
    for f in r["faults"]:
        lines.append(f"| {f['n']} | {f['kind']} | {f['at_s']:.0f} | {f['target'] or '-'} | "
                     f"{'-' if f['kind'] == 'foreign_server' else _s(f['to_serving_s'])} | {f['failed']} |")
    lines += real_cases()
    lines.append(END)
    return "\n".join(lines) + "\n"


def splice(doc: str, section: str) -> str:
    """``doc`` with its soak-real section replaced by ``section`` (appended if it has none)."""
    if START in doc and END in doc:
        head, rest = doc.split(START, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        return head + section + ("\n" + tail if tail else "")
    return doc.rstrip("\n") + "\n\n" + section


def kept_section(doc: str) -> str:
    """The soak-real section of ``doc`` ("" if it has none): what a regeneration keeps."""
    if START in doc and END in doc:
        return START + doc.split(START, 1)[1].split(END, 1)[0] + END + "\n"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.real.soak_report", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="soak_real's JSON results")
    p.add_argument("-o", "--output", type=Path, default=None, help="splice into this markdown file")
    args = p.parse_args(argv)
    try:
        section = render(json.loads(args.results.read_text()))
    except (OSError, ValueError, KeyError) as exc:
        print(f"soak_report: cannot render {args.results}: {exc!r}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(section)
    else:
        old = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        args.output.write_text(splice(old, section), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
