"""The benchmarks' smoke run (issue 8): ``python -m bench --quick`` end to end, tiny sizes.

No timing is asserted here (timing claims live in bench/results.json and the README); the
run keeps the bench from rotting: every row must come out measured, as numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import IN_CI

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `bench` is a top-level directory of the repo, not installed
    sys.path.insert(0, str(REPO))

from bench import report  # noqa: E402 - after the path fix above
from bench.supervisord import SupervisordUnavailable, ensure_venv  # noqa: E402

ROWS = {
    "crash_noticed_p50", "crash_noticed_p99", "crash_diagnosed_p50", "crash_diagnosed_p99",
    "relaunch_p50", "relaunch_p99", "hang_noticed", "steady_cpu", "steady_rss",
    "logs_format", "logs_format_vs_cat", "logs_raw", "logs_raw_vs_cat",
    "cold_version", "cold_first_exec", "cold_imports", "explain_1mb",
    "steady_cpu_kv", "climb_decided", "climb_serving", "climb_total", "reexec_gap_p50", "reexec_gap_max",
    "rss_serving", "rss_after_crashes",
}
SIDE_BY_SIDE = {
    "crash_noticed_p50", "crash_noticed_p99", "relaunch_p50", "relaunch_p99", "steady_cpu", "steady_rss",
    "logs_format", "logs_format_vs_cat", "logs_raw", "logs_raw_vs_cat", "cold_version", "cold_first_exec",
}


@pytest.fixture(scope="module")
def supervisord() -> Path:
    """supervisord 4.3 in its own virtualenv (pip-installed on first use)."""
    try:
        return ensure_venv()
    except SupervisordUnavailable as exc:
        if IN_CI:
            pytest.fail(f"supervisord is needed for the benchmarks: {exc}")
        pytest.skip(f"supervisord unavailable (not in CI): {exc}")
        raise AssertionError("unreachable") from None


def _number(stat: dict[str, Any] | None) -> bool:
    return stat is not None and all(
        isinstance(stat[k], int | float) and math.isfinite(stat[k]) for k in ("value", "low", "high")
    ) and stat["n"] >= 1


@pytest.mark.timeout(420)
def test_quick_bench_measures_every_row(tmp_path: Path, no_leftovers: str, supervisord: Path) -> None:
    """A quick run writes every row, ours as numbers and supervisord's beside it where it applies."""
    results = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--results", str(results), "--no-readme"],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(results.read_text())
    assert data["errors"] == {}
    assert data["quick"] is True and data["supervisord"] == "4.3.0"
    rows = {row["key"]: row for row in data["rows"]}
    assert set(rows) == ROWS
    for key, row in rows.items():
        assert row["text"] or _number(row["ours"]), key
        if key in SIDE_BY_SIDE:
            assert _number(row["supervisord"]), key
            assert isinstance(row["ratio"], float) and math.isfinite(row["ratio"]), key
    assert rows["cold_imports"]["met"] is True
    assert rows["explain_1mb"]["met"] is True


def test_table_replaces_only_the_marked_section(tmp_path: Path) -> None:
    """Rendering rewrites what lies between the bench markers and leaves the rest of the README."""
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{report.START}\nold table\n{report.END}\n\nafter\n")
    stat = {"value": 2.5, "low": 2.0, "high": 3.0, "n": 3}
    results = {
        "date": "2026-11-29 07:00 UTC", "command": "make bench", "repeats": 3, "supervisord": "4.3.0",
        "machine": {"cpus": 2, "cpu": "cpu", "memory_gb": 8.0, "kernel": "6.1", "python": "3.11",
                    "loadavg_at_start": [0.1, 0.2, 0.3]},
        "rows": [{"key": "crash_noticed_p50", "title": "crash → noticed, p50", "unit": "ms", "ours": stat,
                  "supervisord": stat, "ratio": 1.0, "goal": "≤ 2 ms", "met": False, "note": "a note", "text": ""}],
        "notes": [], "errors": {},
    }
    report.update_readme(readme, report.table(results))
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith(f"{report.END}\n\nafter\n")
    assert "old table" not in text
    assert "| crash → noticed, p50 [1] | 2.50 ms (2.00–3.00) | 2.50 ms (2.00–3.00) | 1.00 | ≤ 2 ms | **no** |" in text
