"""``python -m bench [--quick] [--only NAME ...]``: run the benchmarks, write the results.

Runs each measurement (``crash``, ``hang``, ``steady``, ``logs``, ``cold``, ``explain``) on
the simulator, ours and supervisord's interleaved, writes ``bench/results.json`` (with
``--only``, the other sections of an existing file are kept) and renders the README table.
``--quick`` is the CI smoke size: tiny, one repeat, and the README is left alone unless
``--readme`` is given; ``--render`` only re-renders the README from the results file.
Exit status 1 when a measurement failed (the others still run).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import shlex
import shutil
import sys
import tempfile
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import report
from .common import BENCH, REPO, Section, Settings, reap_tagged
from .supervisord import VERSION, ensure_venv

SECTIONS = ("crash", "hang", "steady", "rss", "logs", "cold", "explain", "climb", "reexec")  # bench/bench_<name>.py
NEEDS_SUPERVISORD = frozenset({"crash", "steady", "logs", "cold"})


def _run(name: str, settings: Settings, exe: Path | None) -> Section:
    module = importlib.import_module(f".bench_{name}", __package__)
    if name == "reexec":
        return module.section(settings)  # its own ``run`` is its command line's
    return module.run(settings, exe) if name in NEEDS_SUPERVISORD else module.run(settings)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (the CI smoke run)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, metavar="NAME",
                   help=f"run only these ({', '.join(SECTIONS)})")
    p.add_argument("--repeats", type=int, default=None, help="repeats per measurement (3; quick: 1)")
    p.add_argument("--results", type=Path, default=BENCH / "results.json", help="where to write the JSON")
    p.add_argument("--readme", type=Path, default=None, help="README to render into (full runs: README.md)")
    p.add_argument("--no-readme", action="store_true", help="leave the README alone")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--render", action="store_true", help="measure nothing: render the README from --results")
    return p.parse_args(argv)


def _previous(path: Path, quick: bool) -> dict[str, Any]:
    """Sections of an earlier results file of the same size, kept by a partial run."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return old.get("sections", {}) if old.get("quick") == quick else {}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        report.update_readme(args.readme or REPO / "README.md", report.table(json.loads(args.results.read_text())))
        return 0
    names = args.only or list(SECTIONS)
    repeats = args.repeats or (1 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="sgl-bench-"))  # short: supervisord's unix socket path
    settings = Settings(quick=args.quick, repeats=repeats, work=work, tag=uuid.uuid4().hex)
    started = _dt.datetime.now(_dt.UTC)
    sections = _previous(args.results, args.quick) if args.only else {}
    errors: dict[str, str] = {}
    machine = report.machine()
    try:
        exe = ensure_venv() if NEEDS_SUPERVISORD & set(names) else None
        for name in names:
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            try:
                section = _run(name, settings, exe)
            except Exception as exc:  # noqa: BLE001 - one failed measurement must not lose the others
                traceback.print_exc()
                errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                sections.pop(name, None)
                continue
            sections[name] = {"rows": [r.to_dict() for r in section.rows], "raw": section.raw, "notes": section.notes}
            for row in section.rows:
                print(f"  {row.key}: ours {row.ours and round(row.ours.value, 4)} "
                      f"supervisord {row.supervisord and round(row.supervisord.value, 4)} met {row.met}",
                      file=sys.stderr, flush=True)
    finally:
        leftovers = reap_tagged(settings.tag)
        if leftovers:
            errors["leftovers"] = f"killed leftover processes {leftovers}"
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": "make bench" if not args.quick and not args.only else "python -m bench " + shlex.join(
            sys.argv[1:] if argv is None else list(argv)),
        "machine": machine,
        "quick": args.quick,
        "repeats": repeats,
        "supervisord": VERSION,
        "rows": [row for name in SECTIONS if name in sections for row in sections[name]["rows"]],
        "notes": [n for name in SECTIONS if name in sections for n in sections[name]["notes"]],
        "sections": sections,
        "errors": errors,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    readme = args.readme or (None if args.quick else REPO / "README.md")
    if readme is not None and not args.no_readme:
        report.update_readme(readme, report.table(results))
    print(f"bench: wrote {args.results}" + (f" and {readme}" if readme and not args.no_readme else ""), file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
