"""The report as one self-contained HTML file: inline CSS, the charts as base64 PNGs, no
script and nothing fetched from the network."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from datetime import datetime, tzinfo

from supervisor.report import (
    FRACTION_HEADING,
    UNNAMED_HELP,
    ServerNight,
    chart,
    event_line,
    fraction_lines,
    notable,
    summary_rows,
    unnamed_crashes,
    unnamed_when,
)
from supervisor.report.crashes import crash_columns, zone_label

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1240px;
       color: #1b1b1b; background: #fff; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 1.6em; }
.meta { color: #555; }
.todo { background: #fff4e5; border-left: 4px solid #ff7f0e; padding: 8px 16px; }
.todo.ok { background: #eef8ee; border-left-color: #2ca02c; }
.fraction { background: #eef3fb; border-left: 4px solid #08306b; padding: 8px 16px; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.t { white-space: nowrap; font-variant-numeric: tabular-nums; color: #444; }
tr.crash td { color: #b00; font-weight: 600; }
img.chart { width: 100%; max-width: 1200px; border: 1px solid #eee; }
code.line { white-space: pre-wrap; word-break: break-all; }
table.about th { width: 11em; }
table.about code, table.crashes code { white-space: pre-wrap; overflow-wrap: break-word; }
table.crashes { width: 100%; table-layout: fixed; }
table.crashes td { overflow-wrap: break-word; }
table.crashes th:nth-child(1) { width: 6.5em; } table.crashes th:nth-child(2) { width: 6em; }
table.crashes th:nth-child(3) { width: 3.5em; } table.crashes th:nth-child(4) { width: 15%; }
table.crashes th:nth-child(5) { width: 14%; } table.crashes th:nth-child(7) { width: 16%; }
table.crashes td.where, table.crashes td.evidence { font-family: ui-monospace, monospace; font-size: 0.9em; }
pre.rule { background: #f6f8fa; border: 1px solid #ddd; padding: 6px 10px; margin: 4px 0; white-space: pre-wrap;
           word-break: break-all; }
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def render(nights: Sequence[ServerNight], *, tz: tzinfo, title: str, titles: Sequence[str]) -> str:
    """The whole page."""
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
    ]
    for sn, chart_title in zip(nights, titles, strict=True):
        n = sn.night
        parts.append(f'<section id="server-{_e(sn.name)}">')
        if len(nights) > 1:
            parts.append(f"<h2>Server {_e(sn.name)}</h2>")
        zone = zone_label(tz, n.end)
        parts.append(f'<p class="meta">{datetime.fromtimestamp(n.start, tz):%Y-%m-%d %H:%M} – '
                     f"{datetime.fromtimestamp(n.end, tz):%Y-%m-%d %H:%M} {_e(zone)} · state directory "
                     f"{_e(sn.state_dir)}</p>")
        if sn.about:
            parts.append('<table class="about">' + "".join(
                f"<tr><th>{_e(k)}</th><td>" + (f"<code>{_e(v)}</code>" if k == "launch command" else _e(v)) + "</td></tr>"
                for k, v in sn.about) + "</table>")
        parts.append("<h3>What to do now</h3>")
        if sn.todo:
            parts.append('<ul class="todo">' + "".join(f"<li>{_e(s)}</li>" for s in sn.todo) + "</ul>")
        else:
            parts.append('<ul class="todo ok"><li>Nothing: no open problem.</li></ul>')
        said, climbed = fraction_lines(n, tz)
        if said or climbed:
            parts.append(f"<h3>{_e(FRACTION_HEADING)}</h3>")
            items = [f"<li>{_e(s)}</li>" for s in said]
            if climbed:
                items.append("<li>Climbs:<ul>" + "".join(f"<li>{_e(c)}</li>" for c in climbed) + "</ul></li>")
            parts.append('<ul class="fraction">' + "".join(items) + "</ul>")
        image = base64.b64encode(chart.png([sn], tz, [chart_title])).decode()
        parts.append(f'<img class="chart" alt="timeline of {_e(sn.name)}" src="data:image/png;base64,{image}">')
        parts.append("<h3>Summary</h3><table>")
        parts += [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in summary_rows(sn)]
        parts.append("</table>")
        if sn.crashes:
            names = crash_columns(tz, sn.crashes[-1].t)
            classes = ("t", "server", "rank", "cause", "where", "evidence", "remedy")
            parts.append(f"<h3>Crashes ({len(sn.crashes)})</h3>")
            parts.append('<table class="crashes"><tr>' + "".join(f"<th>{_e(c)}</th>" for c in names) + "</tr>")
            for row in sn.crashes:
                parts.append('<tr class="crash-row">' + "".join(
                    f'<td class="{cls}">{_e(cell)}</td>' for cls, cell in zip(classes, row.cells(), strict=True))
                    + "</tr>")
            parts.append("</table>")
        unnamed = unnamed_crashes(sn.records)
        if unnamed:
            parts.append(f'<h3>Crashes it could not name</h3><p class="meta">{_e(UNNAMED_HELP)}</p>')
            parts.append('<table class="unnamed"><tr><th>when</th><th>read as</th><th>the line, and the rule to paste</th></tr>')
            for u in unnamed:
                rule = (f'<pre class="rule">{_e(u.rule)}</pre>' if u.rule
                        else "<p>(too little text in it for a rule)</p>")
                parts.append(f'<tr><td class="t">{_e(unnamed_when(u, tz))}</td><td>{_e(u.reading)}</td>'
                             f'<td><code class="line">{_e(u.line)}</code>{rule}</td></tr>')
            parts.append("</table>")
        parts.append(f"<h3>The night's events</h3><table><tr><th>time ({_e(zone)})</th><th>event</th></tr>")
        for r in notable(sn.records):
            cls = ' class="crash"' if r.get("kind") in ("crash", "gave_up") else ""
            parts.append(f'<tr{cls}><td class="t">{datetime.fromtimestamp(float(r["t"]), tz):%H:%M:%S}</td>'
                         f"<td>{_e(event_line(r))}</td></tr>")
        parts.append("</table></section>")
    parts.append("</body></html>")
    return "\n".join(parts)
