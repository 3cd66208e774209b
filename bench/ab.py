"""``python -m bench.ab --before REV [--only crash steady] [--repeats N]``: one tree against
another, side by side.

A redesign that should change nothing measurable (issue 24: "behaviour unchanged") is
checked here: the same benchmark sections run against the tree at ``REV`` (a temporary git
worktree) and against this one, alternating (before, after, after, before, ...) so that the
machine's drift falls on both alike. Each run puts its tree first on ``PYTHONPATH``: the
daemon, the simulator and the stamping trampoline all come from that tree (``bench.common``
launches ``python -m supervisor.cli`` in a scratch directory). supervisord runs in every
section too: its figures, measured twice, show what noise alone moves. Writes
``bench/results-ab.json`` and prints the table: each row's value before, after, and their
ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .__main__ import NEEDS_SUPERVISORD, _run
from .common import BENCH, REPO, Settings, reap_tagged
from .supervisord import ensure_venv


def _worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="sgl-ab-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO, check=True,
                   capture_output=True)
    return path


def _drop(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the git revision to compare this tree with")
    p.add_argument("--only", nargs="+", default=["crash", "steady"], metavar="NAME")
    p.add_argument("--repeats", type=int, default=2, help="runs per tree and section (alternating)")
    p.add_argument("--results", type=Path, default=BENCH / "results-ab.json")
    args = p.parse_args(argv)
    before = _worktree(args.before)
    trees = {"before": before, "after": REPO}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    exe = ensure_venv() if NEEDS_SUPERVISORD & set(args.only) else None
    old_path = os.environ.get("PYTHONPATH")
    os.environ["BENCH_STEADY_KV"] = "0"  # the other tree's simulator may not serve /metrics
    try:
        for r in range(args.repeats):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for who in order:
                os.environ["PYTHONPATH"] = os.pathsep.join([str(trees[who]), *([old_path] if old_path else [])])
                work = Path(tempfile.mkdtemp(prefix="sgl-ab-run-"))
                settings = Settings(quick=False, repeats=1, work=work, tag=uuid.uuid4().hex)
                try:
                    for name in args.only:
                        print(f"bench.ab: {name} ({who}, run {r + 1})", file=sys.stderr, flush=True)
                        for row in _run(name, settings, exe).rows:
                            rows.setdefault(row.key, {}).setdefault(who, []).append(row.to_dict())
                finally:
                    reap_tagged(settings.tag)
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
        _drop(before)
    table = []
    for key, by in rows.items():
        b, a = _median(by, "before", "ours"), _median(by, "after", "ours")
        sb, sa = _median(by, "before", "supervisord"), _median(by, "after", "supervisord")
        unit = by.get("after", by.get("before", [{}]))[0].get("unit", "")
        table.append({"key": key, "unit": unit, "before": b, "after": a, "ratio": a / b if a and b else None,
                      "supervisord_before": sb, "supervisord_after": sa,
                      "supervisord_ratio": sa / sb if sa and sb else None})
    out = {"before": args.before, "after": _head(), "repeats": args.repeats, "sections": args.only, "rows": table}
    args.results.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'row':28} {'before':>10} {'after':>10} {'ratio':>7}   supervisord ratio (noise)")
    for t in table:
        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.4g}"

        print(f"{t['key']:28} {f(t['before']):>10} {f(t['after']):>10} {f(t['ratio']):>7}   {f(t['supervisord_ratio'])}")
    return 0


def _median(by: dict[str, list[dict[str, Any]]], who: str, side: str) -> float | None:
    values = sorted(x[side]["value"] for x in by.get(who, []) if x.get(side))
    return values[len(values) // 2] if values else None


def _head() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return r.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
