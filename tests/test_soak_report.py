"""The real soak's renderer (tests/real/soak_report.py): its section of docs/reliability.md
is spliced in once, replaced on the next render, and kept by the chaos report's regeneration."""

from __future__ import annotations

import json
from pathlib import Path

from tests.chaos import report as chaos_report
from tests.real import soak_report


def results() -> dict:
    fault = {"n": 1, "kind": "sigstop_scheduler", "at_s": 50.0, "target": "a", "to_serving_s": 200.5,
             "requests_in_window": 400, "failed": 2, "failed_router_away": 0,
             "failures": [["TimeoutError()", 2]], "detail": {}, "error": ""}
    return {
        "seed": 7, "minutes": 30, "started": "2026-12-02 04:00 UTC", "command": "SOAK_SEED=7 make soak-real",
        "machine": "Linux, 2 CPUs", "sglang": "0.5.23", "night_s": 1800.0, "faults": [fault],
        "requests": {"total": 1000, "ok": 998, "failed": 2, "failed_in_hang_windows": 2, "failed_router_away": 0,
                     "failed_in_other_windows": 0, "unattributed": 0},
        "alerts": {"logged": 3, "received": 3, "lost": 0, "duplicates": 0},
        "leftovers": [], "foreign": {"started": True, "pid": 9, "processes_seen": 4, "untouched": True},
        "daemon": {"start": {"fds": 24, "threads": 5, "rss_kb": 53000}, "end": {"fds": 24, "threads": 5, "rss_kb": 113000},
                   "rss_change_pct": 113.2, "rss_warm_base": {"rss_kb": 112000}, "rss_warm_change_pct": 0.9,
                   "incarnations": [{}]},
    }


def test_the_section_is_spliced_once_and_replaced(tmp_path: Path) -> None:
    doc = tmp_path / "reliability.md"
    doc.write_text("# Reliability\n\nthe chaos matrix\n")
    src = tmp_path / "r.json"
    src.write_text(json.dumps(results()))
    assert soak_report.main([str(src), "-o", str(doc)]) == 0
    assert soak_report.main([str(src), "-o", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Reliability\n\nthe chaos matrix\n")
    assert text.count(soak_report.START) == 1 and text.count(soak_report.END) == 1
    assert "| SIGSTOP of a scheduler (a hang) | 1 | 200.5 / 200.5 | 400 | **2** |" in text
    assert "**0 lost, 0 duplicated**" in text and "SOAK_SEED=7 make soak-real" in text


def test_the_chaos_report_keeps_the_section(tmp_path: Path) -> None:
    doc = tmp_path / "reliability.md"
    doc.write_text("old chaos tables\n\n" + soak_report.render(results()))
    empty = tmp_path / "results.jsonl"
    empty.write_text("")
    assert chaos_report.main([str(empty), "-o", str(doc)]) == 0
    text = doc.read_text()
    assert "old chaos tables" not in text and text.startswith("# Reliability")
    assert soak_report.kept_section(text) == soak_report.render(results())
