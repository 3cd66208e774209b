"""``sglang-supervisor explain LOGFILE``: say why a server died, as the daemon would read it.

Reads the log (a file, or ``-`` for stdin), runs the same diagnosis the daemon runs on
every crash, and prints the cause, how sure it is (certain or uncertain, and the runner-up
cause when the margin is thin), the evidence with its line number, the location, the rank,
the phase and what it was inferred from, and in one sentence what the supervisor would do
and why. It also reports
the startup facts the log holds (per-rank memory numbers, progress), crashed or not.
``--json`` prints one object instead. ``--config F`` adds F's own words for causes
(``[[diagnosis.rule]]``), tried before anything else, as the daemon does. A line it could not
name is shown with a ready-made rule to teach it. Exit status: 0 whenever a diagnosis was
produced (``other`` included), 2 when the log or the config cannot be read.

Only the tail (``diagnosis.MAX_TAIL_BYTES``) is diagnosed; the whole file is streamed once
for the startup facts and the line numbering, so a huge log costs one sequential read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

from supervisor.cli.common import fail
from supervisor.core.config import ConfigError, load_config
from supervisor.core.diagnosis import MAX_TAIL_BYTES, describe_action, diagnose
from supervisor.core.diagnosis.site_rules import rule_toml
from supervisor.core.diagnosis.startup_facts import StartupFactsParser
from supervisor.core.model import Diagnosis, ExitStatus, Phase, SiteRule, StartupFacts

_CHUNK = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare ``explain``'s arguments on its (sub)parser."""
    p.add_argument("logfile", metavar="LOGFILE", help="the server's log, or - for stdin")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--phase",
        choices=[str(ph) for ph in Phase],
        default=None,
        help="where the server was when it died (default: inferred from the log)",
    )
    p.add_argument(
        "--exit-code",
        type=int,
        default=None,
        metavar="N",
        help="the server's exit status as Popen reports it (-9 = killed by SIGKILL)",
    )
    p.add_argument(
        "--config",
        "-c",
        default=None,
        metavar="F",
        help="read the log with F's own words for causes too ([[diagnosis.rule]]; with several "
        "[[server]], the top-level ones)",
    )


class _Reading:
    """What one pass over the log yields: its tail, the tail's first line number, the facts."""

    def __init__(self) -> None:
        self.parser = StartupFactsParser()
        self.tail = b""
        self.tail_first_lineno = 1

    def consume(self, chunks: Iterable[bytes]) -> None:
        newlines_before_tail = 0
        pending = b""  # an unfinished line carried between chunks
        window = bytearray()  # the last MAX_TAIL_BYTES seen
        dropped = 0  # bytes that left the window
        for chunk in chunks:
            window += chunk
            if len(window) > MAX_TAIL_BYTES:
                excess = len(window) - MAX_TAIL_BYTES
                newlines_before_tail += window.count(b"\n", 0, excess)
                del window[:excess]
                dropped += excess
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            if len(pending) > MAX_TAIL_BYTES:  # one endless line: keep its end only
                pending = pending[-MAX_TAIL_BYTES:]
            for line in lines:
                self.parser.feed(line.decode("utf-8", errors="replace"))
        if pending:
            self.parser.feed(pending.decode("utf-8", errors="replace"))
        self.tail = bytes(window)
        self.tail_first_lineno = newlines_before_tail + 1


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    while chunk := stream.read(_CHUNK):
        yield chunk


def _read(path: str) -> _Reading:
    reading = _Reading()
    if path == "-":
        reading.consume(_chunks(sys.stdin.buffer))
    else:
        with Path(path).open("rb") as f:
            reading.consume(_chunks(f))
    return reading


def startup_dict(facts: StartupFacts) -> dict[str, Any]:
    """Startup facts as JSON-able data (the ``startup`` object of ``--json``)."""
    return {
        "kv_cache_tokens": facts.kv_cache_tokens,
        "max_total_num_tokens": facts.max_total_num_tokens,
        "avail_mem_after_capture_gb": facts.avail_mem_after_capture_gb,
        "mem_fraction_static": facts.mem_fraction_static,
        "progress": facts.progress,
        "ready": facts.ready,
        "ranks": {key: asdict(rank) for key, rank in facts.ranks.items()},
    }


def report(d: Diagnosis, facts: StartupFacts, *, first_lineno: int = 1) -> dict[str, Any]:
    """The ``--json`` object: the diagnosis, the action, the startup facts."""
    out = d.to_dict()
    if d.evidence_lineno is not None:
        out["evidence_lineno"] = d.evidence_lineno + first_lineno - 1
    out["action"] = describe_action(d)
    out["startup"] = startup_dict(facts)
    return out


def _text(obj: dict[str, Any]) -> str:
    certainty = "certain" if obj["certain"] else "uncertain"
    if not obj["certain"]:
        certainty += ": the daemon acts only in the least harmful way (restart, or one rung down for an OOM)"
    rows = [("cause", obj["cause"]), ("certainty", certainty)]
    if obj.get("runner_up"):
        rows.append(("runner-up", obj["runner_up"]))
    phase_from = f" (from {obj['phase_source']})" if obj.get("phase_source") else ""
    rows.append(("phase", obj["phase"] + phase_from))
    if obj.get("min_fraction") is not None:
        rows.append(("min frac", f"SGLang asks for --mem-fraction-static above {obj['min_fraction']}"))
    evidence = obj["evidence"]
    if evidence:
        where = f"line {obj['evidence_lineno']}: " if obj["evidence_lineno"] else ""
        rows.append(("evidence", where + evidence[0]))
        rows.extend(("", line) for line in evidence[1:])
    exception = f"{obj['exc_type']}: {obj['exc_message'] or ''}".rstrip(": ") if obj["exc_type"] else ""
    if exception and not any(exception in line for line in evidence):  # say it once
        rows.append(("exception", exception))
    rows.extend((key, obj[key]) for key in ("location", "rank") if obj[key])
    if obj.get("basis"):
        rows.append(("basis", obj["basis"]))
    rows.append(("action", obj["action"]))
    if obj.get("unrecognised"):
        rows.append(("unnamed", obj["unrecognised"]))
        rule = rule_toml(obj["unrecognised"], obj["cause"])
        if rule is not None:
            rows.append(("teach it", "if you know what this line means, add to the config (docs/diagnosis.md):"))
            rows.extend(("", line) for line in rule.splitlines())
    startup = obj["startup"]
    if startup["ranks"] or startup["progress"] not in ("unknown", "launching"):
        summary = ", ".join(
            f"{k}={startup[k]}" for k in ("kv_cache_tokens", "max_total_num_tokens", "avail_mem_after_capture_gb")
        )
        rows.append(("startup", f"{summary} (progress: {startup['progress']})"))
        for rank, values in startup["ranks"].items():
            known = ", ".join(f"{k}={v}" for k, v in values.items() if k != "rank" and v is not None)
            rows.append(("", f"{rank}: {known}"))
    return "\n".join(f"{key + ':' if key else '':<11}{value}" for key, value in rows)


def run(args: argparse.Namespace) -> int:
    """Run ``explain``; the exit status."""
    site_rules: tuple[SiteRule, ...] = ()
    if getattr(args, "config", None):
        try:
            site_rules = load_config(args.config).diagnosis.rules
        except ConfigError as exc:
            return fail(str(exc))
    try:
        reading = _read(args.logfile)
    except OSError as exc:
        print(f"explain: cannot read {args.logfile}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    exit_status = ExitStatus.from_returncode(args.exit_code) if args.exit_code is not None else None
    phase = Phase(args.phase) if args.phase else None
    d = diagnose(reading.tail, exit_status=exit_status, phase=phase, site_rules=site_rules)
    obj = report(d, reading.parser.facts, first_lineno=reading.tail_first_lineno)
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:  # a log's odd bytes must not crash the report
        reconfigure(errors="replace")
    print(json.dumps(obj) if args.json else _text(obj))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m supervisor.explain``); the CLI wires ``run`` itself."""
    p = argparse.ArgumentParser(prog="sglang-supervisor explain", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
