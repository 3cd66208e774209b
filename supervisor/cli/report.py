"""``sglang-supervisor report``: the morning report of the night, from the state directory.

    sglang-supervisor report --config F [--since 12h] [-o report.html] [--format html|png|text]

``html`` (the default) is one self-contained file; ``png`` the chart alone, for a chat or an
MQTT attachment; ``text`` the summary for a terminal (``-`` or no ``-o``: stdout). The
pictures need the ``[report]`` extra (matplotlib); the text does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
import time
from pathlib import Path

from supervisor.cli.common import fail
from supervisor.core.config import Config, select_server
from supervisor.sinks.journal import JOURNAL, journal_paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--since", default="12h", help="how far back: 12h (default), 90m, 2d")
    p.add_argument("-o", "--output", default=None,
                   help="where to write it (default: report.html / report.png in the current directory; text: stdout)")
    p.add_argument("--format", choices=("html", "png", "text"), default="html")
    p.add_argument("--server", metavar="NAME", help="only this server (a config with several [[server]])")


def run(args: argparse.Namespace, cfg: Config) -> int:
    from supervisor.core.night import parse_duration

    try:
        since_s = parse_duration(args.since)
    except ValueError as exc:
        return fail(f"--since {exc}")
    units = select_server(cfg, args.server)
    if cfg.units:
        cfg = dataclasses.replace(cfg, units=units)  # --server: that server's section only
    if not any(journal_paths(unit.state.dir) for unit in units):
        where = ", ".join(sorted({unit.state.dir for unit in units}))
        return fail(f"no journal in {where}: the daemon writes {JOURNAL} there while it runs with this config "
                    "([report] enabled = true, the default)", 1)
    try:
        path = write_report(cfg, fmt=args.format, output=args.output, since_s=since_s)
    except BrokenPipeError:
        raise  # text to stdout, whose reader went away: main() ends quietly
    except OSError as exc:
        return fail(f"-o {args.output or 'report.' + args.format}: cannot write: {exc.strerror or exc}", 1)
    if path is not None:
        print(path)
    return 0


def write_report(cfg: Config, *, fmt: str, output: str | None, since_s: float,
                 now: float | None = None) -> Path | None:
    """Write the report of each server in ``cfg``; its path (None: text to stdout). Raises
    ``ConfigError`` for a missing extra, like the other commands' bad input."""
    from supervisor import report
    from supervisor.core.config import ConfigError
    from supervisor.services.daily import zone

    now = time.time() if now is None else now  # wall time: the journal's records carry wall times
    tz = zone(cfg.report.timezone)  # the daily summary's zone too
    nights = report.collect(cfg, since_s=since_s, now=now, tz=tz)
    host = socket.gethostname().split(".")[0]
    title = f"sglang-supervisor: the night of {cfg.name} on {host}"
    titles = [_chart_title(sn, len(nights) > 1) for sn in nights]
    if fmt == "text":
        out = report.text(nights, tz=tz, title=title)
        if output in (None, "-"):
            sys.stdout.write(out + "\n")
            return None
        path = Path(output)
        path.write_text(out + "\n", encoding="utf-8")
        return path.resolve()
    from supervisor.report import chart

    why = chart.missing()
    if why is not None:
        raise ConfigError(why)
    path = Path(output or f"report.{fmt}")
    if fmt == "png":
        path.write_bytes(chart.png(nights, tz, titles))
    else:
        from supervisor.report import page

        path.write_text(page.render(nights, tz=tz, title=title, titles=titles), encoding="utf-8")
    return path.resolve()


def demo_report(cfg: Config, path: Path) -> Path:
    """The demo night's report: HTML with the ``[report]`` extra, else the text one (saying so)."""
    from supervisor.report import chart

    if chart.missing() is not None and path.suffix == ".html":
        path = path.with_suffix(".txt")
        print(chart.missing())
    fmt = "html" if path.suffix == ".html" else "png" if path.suffix == ".png" else "text"
    written = write_report(cfg, fmt=fmt, output=str(path), since_s=24 * 3600)
    assert written is not None
    return written


def _chart_title(sn: object, several: bool) -> str:
    from supervisor.report import ServerNight, duration

    assert isinstance(sn, ServerNight)
    n = sn.night
    crashes = ", ".join(f"{c} × {k}" for c, k in n.crashes) or "no crash"
    name = f"{sn.name}: " if several else ""
    frac = (f"{n.fraction_start:g} → {n.fraction_end:g}" if n.fraction_start is not None and n.fraction_end is not None
            else "fraction: SGLang's default")
    return (f"{name}serving {n.serving_pct:.0f} % · {crashes} · {duration(n.lost_crash_s + n.lost_restart_s)} lost"
            f" · {frac} · now {n.state}")
