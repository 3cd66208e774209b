"""The journal sink: notable events as JSON lines in the state dir, bounded, rotated, never raising."""

from __future__ import annotations

import json
import time

import pytest

from supervisor.core import events as ev
from supervisor.core.model import Cause, Phase, Remedy, State
from supervisor.sinks.journal import JOURNAL, JournalSink, journal_paths, read_journal


def crash(**over: object) -> ev.Crash:
    base = dict(cause=Cause.CUDA_OOM_RUNTIME, remedy=list(Remedy)[0], phase=list(Phase)[-1], exit_code=1, signal=None,
                evidence=tuple(f"line {i}" for i in range(20)), evidence_lineno=3, location="deepseek_v2.py forward",
                rank="TP0", exc_type="OutOfMemoryError", exc_message="CUDA out of memory", mem_fraction_static=0.93,
                hicache_size_gb=0.0, attempt=1, next_mem_fraction_static=0.88, next_hicache_size_gb=0.0,
                next_retry_s=2.0, consecutive_failures=1)
    base.update(over)
    return ev.Crash(host="h", instance="demo", **base)  # type: ignore[arg-type]


def test_notable_events_are_lines_with_wall_time_and_quiet_ones_are_not(tmp_path):
    """A state change and a crash are journaled with ``t`` and ``ts``; probes and GPU samples are not."""
    sink = JournalSink(tmp_path, clock=lambda: 1764470531.25)
    sink.emit(ev.StateChanged(from_=State.STARTING, to=State.READY, reason="ready", mem_fraction_static=0.93,
                              hicache_size_gb=None, restarts=0, last_cause=None))
    sink.emit(ev.ProbeAnswered(ok=True, duration_s=0.01, status=200, error=None))
    sink.emit(ev.GpuSample(gpus=({"index": 0, "free_bytes": 1},)))
    sink.emit(crash())
    sink.emit(ev.ServerLaunched(argv=("python", "--api-key", "secret"), mem_fraction_static=0.88,
                                hicache_size_gb=None, attempt=2, pid=42, rung=1, launch_id="x"))
    lines = (tmp_path / JOURNAL).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["kind"] for r in records] == ["state_changed", "crash", "launch"]
    assert records[0]["t"] == 1764470531.25 and records[0]["ts"] == "2025-11-30T02:42:11.250Z"
    assert records[1]["cause"] == "cuda_oom_runtime" and len(records[1]["evidence"]) == 8
    # the launch command is kept for the report's header, its secrets redacted as in the log
    assert records[2]["argv"] == ["python", "--api-key", "***"] and "secret" not in (tmp_path / JOURNAL).read_text()
    assert [r["kind"] for r in read_journal(tmp_path)] == ["state_changed", "crash", "launch"]
    assert [r["kind"] for r in read_journal(tmp_path, since=1764470531.26)] == []


def test_rotates_at_max_bytes_and_keeps_only_the_backups(tmp_path):
    """Past max_bytes the file becomes .1, .1 becomes .2...; no more than ``backups`` old files."""
    t = [0.0]

    def clock() -> float:
        t[0] += 1
        return t[0]

    sink = JournalSink(tmp_path, max_bytes=2000, backups=2, clock=clock)
    for i in range(200):
        sink.emit(ev.Stable(after_s=float(i)))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [JOURNAL, f"{JOURNAL}.1", f"{JOURNAL}.2"]
    assert all(p.stat().st_size < 2000 + 200 for p in tmp_path.iterdir())
    times = [r["t"] for r in read_journal(tmp_path)]
    assert times == sorted(times) and times[-1] == 200.0  # oldest first, the newest kept
    assert len(journal_paths(tmp_path)) == 3


def test_a_write_error_never_raises_and_is_reported_once(tmp_path):
    """An unwritable state dir: emit returns, the error is reported once per episode."""
    blocked = tmp_path / "file"
    blocked.write_text("not a dir")
    errors: list[str] = []
    sink = JournalSink(blocked / "state", on_error=errors.append)
    for _ in range(3):
        sink.emit(ev.Stable(after_s=1.0))
    assert sink.errors == 3 and len(errors) == 1


def test_an_emit_costs_microseconds(tmp_path):
    """The sink contract: no noticeable time on the event loop (well under a millisecond each)."""
    sink = JournalSink(tmp_path)
    event = crash()
    start = time.perf_counter()
    for _ in range(500):
        sink.emit(event)
    per_emit = (time.perf_counter() - start) / 500
    assert per_emit < 1e-3, per_emit


def test_one_rfc3339_writer_for_a_unix_time_and_a_datetime_of_any_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chaos matrix's jumping clock replaces ``datetime.datetime`` with a subclass whose
    ``now()`` returns the base class: a writer that told the two apart by ``isinstance`` of
    its own ``datetime`` took a datetime for a Unix time and the daemon died at its first step."""
    import datetime as dt

    from supervisor.core import model

    when = dt.datetime(2026, 10, 4, 3, 12, 9, 123000, tzinfo=dt.UTC)

    class Shifted(dt.datetime):
        pass

    monkeypatch.setattr(model, "datetime", Shifted)
    assert {model.rfc3339(when), model.rfc3339(when.timestamp()), model.rfc3339(Shifted.fromtimestamp(when.timestamp(), dt.UTC))} == {
        "2026-10-04T03:12:09.123Z"}


def test_evidence_is_cut_at_a_space_never_inside_a_word(tmp_path):
    """The evidence line the report shows whole keeps up to FIRST_EVIDENCE_CHARS (a CUDA OOM's
    ~700 characters fit); a longer line, and the other lines past EVIDENCE_CHARS, end at a
    word with " …"."""
    from supervisor.sinks.journal import EVIDENCE_CHARS, FIRST_EVIDENCE_CHARS, clip

    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "139.81 GiB of which 1.19 GiB is free. Including non-PyTorch memory, this process has 138.60 GiB memory "
           "in use. " * 3)
    words = " ".join(f"word{k}" for k in range(600))
    sink = JournalSink(tmp_path, clock=lambda: 1.0)
    sink.emit(crash(evidence=(oom, words, words)))
    first, second, _ = next(iter(read_journal(tmp_path)))["evidence"]
    assert first == oom and len(oom) > EVIDENCE_CHARS
    assert second.endswith(" …") and len(second) <= EVIDENCE_CHARS
    assert words.startswith(second.removesuffix(" …") + " ")  # ends on a whole word
    assert clip(words, FIRST_EVIDENCE_CHARS).removesuffix(" …").split(" ")[-1] in words.split(" ")
    assert clip("x" * 30, 10) == "x" * 8 + " …"  # one word longer than the limit: cut where it must
