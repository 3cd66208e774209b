"""``sglang-supervisor explain LOGFILE``: say why a server died, as the daemon would read it.

Reads the log (a file, or ``-`` for stdin), runs the same diagnosis the daemon runs on
every crash, and prints the cause, how sure it is (certain or uncertain, and the runner-up
cause when the margin is thin), the evidence with its line number, the location, the rank,
the phase and what it was inferred from, and in one sentence what the supervisor would do
and why. It also reports
the startup facts the log holds (per-rank memory numbers, progress), crashed or not.
``--json`` prints one object instead. ``--config F`` adds F's own words for causes
(``[[diagnosis.rule]]``), tried before anything else, as the daemon does. A line it could not
name is shown with a ready-made rule to teach it.

A log with several launches (the daemon's ``=== sglang-supervisor launch N at ...`` markers,
or, without them, a start-up after SGLang's READY line; ``core/diagnosis/launches.py``) is
read one launch at a time: the last launch that ended, or ``--launch N`` (counted from 1 in
the log). It says "launch N of M: crashed / stopped cleanly / still running", and the startup
facts are that launch's only. When the last launch is still running (no death logged), the
one before it is read, and it says so.

Exit status: 0 whenever a diagnosis was produced (``other`` and a clean stop included), 2
when the log or the config cannot be read, the log is empty, or it holds no launch N.

Only the tail (``diagnosis.MAX_TAIL_BYTES``) of the launch is diagnosed; the whole file is
streamed once for the launches, their startup facts and the line numbering, so a huge log
costs one sequential read.
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
from supervisor.core.diagnosis import MAX_TAIL_BYTES, describe_action, diagnose, tail_text
from supervisor.core.diagnosis.launches import LaunchEnd, LaunchMarker, LaunchSplitter, launch_end
from supervisor.core.diagnosis.site_rules import rule_toml
from supervisor.core.diagnosis.startup_facts import StartupFactsParser
from supervisor.core.model import Diagnosis, ExitStatus, Phase, SiteRule, StartupFacts

_CHUNK = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare ``explain``'s arguments on its (sub)parser."""
    p.add_argument("logfile", metavar="LOGFILE", help="the server's log, or - for stdin")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--launch",
        type=int,
        default=None,
        metavar="N",
        help="read the log's N-th launch (1 = the first in the log; default: the last one that ended)",
    )
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


class _Span:
    """One launch as the log is streamed: where it begins, its facts, the end of its text."""

    __slots__ = ("dropped", "first_lineno", "has_text", "marker", "number", "parser", "window")

    def __init__(self, number: int, marker: LaunchMarker | None, first_lineno: int, keep: bool) -> None:
        self.number = number
        self.marker = marker
        self.first_lineno = first_lineno
        self.parser = StartupFactsParser()
        self.window: bytearray | None = bytearray() if keep else None  # its last MAX_TAIL_BYTES
        self.dropped = 0  # line ends that left the window
        self.has_text = False  # a line that is not blank

    def add(self, data: bytes, limit: int = 2 * MAX_TAIL_BYTES) -> None:
        if self.window is None:
            return
        self.window += data
        if len(self.window) > limit:
            excess = len(self.window) - MAX_TAIL_BYTES
            self.dropped += self.window.count(b"\n", 0, excess)
            del self.window[:excess]

    @property
    def tail(self) -> bytes:
        self.add(b"", MAX_TAIL_BYTES)
        return bytes(self.window or b"")

    @property
    def tail_first_lineno(self) -> int:
        return self.first_lineno + self.dropped


class _Reading:
    """What one pass over the log yields: its launches, each with its facts; the tails of
    the launches that may be read (``keep``: that one; else the last two)."""

    def __init__(self, keep: int | None = None) -> None:
        self.spans: list[_Span] = []
        self.splitter = LaunchSplitter()
        self.keep = keep
        self.lineno = 0
        self._buf, self._seg = b"", 0  # the chunk being read, and how much of it a launch holds

    def _line(self, line: bytes, pos: int) -> None:
        """Read one line (without its newline), which starts at ``pos`` in the buffer."""
        text = line.decode("utf-8", errors="replace")
        self.lineno += 1
        begins = self.splitter.feed(text)
        spans = self.spans
        if begins is not False or not spans:
            self._flush(pos)  # what came before is the last launch's
            if spans and spans[-1].marker is None and not spans[-1].has_text:
                spans.pop()  # only blank lines before the first launch's start
            number = len(spans) + 1
            marker = begins if isinstance(begins, LaunchMarker) else None
            spans.append(_Span(number, marker, self.lineno, self.keep in (None, number)))
            if self.keep is None and len(spans) >= 3:
                spans[-3].window = None
        span = spans[-1]
        span.parser.feed(text)
        if not span.has_text and text.strip():
            span.has_text = True

    def _flush(self, pos: int) -> None:
        """Add the buffer up to ``pos`` (from where the last flush ended) to the current launch."""
        if self.spans and pos > self._seg:
            self.spans[-1].add(self._buf[self._seg:pos])
        self._seg = pos

    def consume(self, chunks: Iterable[bytes]) -> None:
        pending = b""  # an unfinished line carried between chunks
        for chunk in chunks:
            self._buf, self._seg = pending + chunk, 0
            lines = self._buf.split(b"\n")
            pending = lines.pop()
            pos = 0
            for line in lines:
                self._line(line, pos)
                pos += len(line) + 1
            self._flush(pos)
            if len(pending) > MAX_TAIL_BYTES:  # one endless line: keep its end only
                pending = pending[-MAX_TAIL_BYTES:]
        if pending:
            self._buf, self._seg = pending, 0
            self._line(pending, 0)
            self._flush(len(pending))

    @property
    def empty(self) -> bool:
        return not any(span.has_text for span in self.spans)


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    while chunk := stream.read(_CHUNK):
        yield chunk


def _read(path: str, keep: int | None = None) -> _Reading:
    reading = _Reading(keep)
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


def report(
    d: Diagnosis, facts: StartupFacts, *, first_lineno: int = 1, launch: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``--json`` object: the diagnosis, the action, the startup facts, the launch read."""
    out = d.to_dict()
    if d.evidence_lineno is not None:
        out["evidence_lineno"] = d.evidence_lineno + first_lineno - 1
    out["action"] = describe_action(d)
    out["startup"] = startup_dict(facts)
    if launch is not None:
        out["launch"] = launch
    return out


def launch_dict(span: _Span, count: int, end: LaunchEnd, note: str | None) -> dict[str, Any]:
    """The ``launch`` object of ``--json``: which launch was read, of how many, how it ended."""
    marker = span.marker
    return {
        "number": span.number,
        "of": count,
        "outcome": end.outcome,
        "words": end.words,
        "first_lineno": span.first_lineno,
        "stop_lineno": None if end.stop_lineno is None else end.stop_lineno + span.tail_first_lineno - 1,
        "stop_line": end.stop_line,
        "attempt": marker.attempt if marker else None,
        "at": marker.wall if marker else None,
        "argv": marker.argv if marker else None,
        "note": note,
    }


def _launch_rows(launch: dict[str, Any]) -> list[tuple[str, str]]:
    said = f"{launch['number']} of {launch['of']}: {launch['words']}"
    if launch["attempt"] is not None:
        said += f" (the daemon's launch {launch['attempt']} at {launch['at']}, line {launch['first_lineno']})"
    elif launch["of"] > 1:
        said += f" (from line {launch['first_lineno']})"
    rows = [("launch", said)]
    if launch["note"]:
        rows.append(("", launch["note"]))
    if launch["outcome"] == "stopped":
        rows.append(("stopped", f"line {launch['stop_lineno']}: {launch['stop_line']}"))
    return rows


def _diagnosis_rows(obj: dict[str, Any]) -> list[tuple[str, str]]:
    certainty = "certain" if obj["certain"] else "uncertain"
    if not obj["certain"]:
        certainty += (": unsure, so the daemon acts only in the least harmful way (restarting with backoff, or one "
                      "rung down for an OOM) and never stops on it; it gives up if it repeats")
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
    return rows


def _text(obj: dict[str, Any]) -> str:
    launch = obj.get("launch")
    rows = _launch_rows(launch) if launch else []
    if not launch or launch["outcome"] != "stopped":  # a clean stop has no cause to tell
        rows.extend(_diagnosis_rows(obj))
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


def _explain_launch(
    reading: _Reading, requested: int | None, *, exit_status: ExitStatus | None, phase: Phase | None,
    site_rules: tuple[SiteRule, ...],
) -> dict[str, Any]:
    """The report on the launch asked for, else on the last one that ended."""
    spans = reading.spans
    count = len(spans)

    def read(span: _Span) -> tuple[Diagnosis, LaunchEnd]:
        tail = span.tail
        d = diagnose(tail, exit_status=exit_status, phase=phase, site_rules=site_rules)
        ended = span.number < count or exit_status is not None  # an exit status says it died
        return d, launch_end(tail_text(tail), d, followed=ended)

    span = spans[(requested or count) - 1]
    d, end = read(span)
    note = None
    if requested is None and end.outcome == "running" and count > 1:
        note = f"launch {count} of {count} is still running (no death is logged since it began); this is the last one that ended"
        span = spans[-2]
        d, end = read(span)
    launch = launch_dict(span, count, end, note)
    return report(d, span.parser.facts, first_lineno=span.tail_first_lineno, launch=launch)


def run(args: argparse.Namespace) -> int:
    """Run ``explain``; the exit status."""
    site_rules: tuple[SiteRule, ...] = ()
    if getattr(args, "config", None):
        try:
            site_rules = load_config(args.config).diagnosis.rules
        except ConfigError as exc:
            return fail(str(exc))
    requested = getattr(args, "launch", None)
    name = "stdin" if args.logfile == "-" else args.logfile
    if requested is not None and requested < 1:
        print(f"explain: --launch {requested}: launches are counted from 1", file=sys.stderr)
        return 2
    try:
        reading = _read(args.logfile, requested)
    except OSError as exc:
        print(f"explain: cannot read {args.logfile}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if reading.empty:
        print(f"explain: {name} is empty: there is no log to read", file=sys.stderr)
        return 2
    count = len(reading.spans)
    if requested is not None and requested > count:
        held = "1 launch" if count == 1 else f"{count} launches (1-{count})"
        print(f"explain: --launch {requested}: {name} holds {held}", file=sys.stderr)
        return 2
    exit_status = ExitStatus.from_returncode(args.exit_code) if args.exit_code is not None else None
    phase = Phase(args.phase) if args.phase else None
    obj = _explain_launch(reading, requested, exit_status=exit_status, phase=phase, site_rules=site_rules)
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
