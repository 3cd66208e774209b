"""Render ``docs/dashboard.png``: the Grafana dashboard's panels drawn from a real scrape.

It starts a real Prometheus (``/usr/bin/prometheus``, a temporary TSDB, free loopback
ports), runs the simulated seed night (``python -m supervisor.cli demo --hold 20``) with its
metrics on a free port, waits for the demo to end, then runs every target of every panel of
``etc/grafana/sglang-supervisor.json`` against Prometheus's HTTP API (range queries over the
demo's window; instant queries, as the "Now" stats use, at the last moment the server was
up) with Grafana's variables filled in as Grafana would, and draws them with matplotlib in a
grid that mirrors the dashboard's layout. It is not a Grafana screenshot; the image says so.

The demo compresses the night: its first READY lasts ~0.15 s before the OOM. A 1 s scrape
misses it (no ``up`` 1 -> 0 -> 1), so Prometheus scrapes every 0.1 s and the queries step
by as much (``--scrape-interval``); ``$__rate_interval`` follows (4 x scrape interval).

    .venv/bin/python scripts/render_dashboard.py [--out docs/dashboard.png] [--hold 20]

Prometheus and the demo are always stopped; their files live in a temporary directory
(the demo's own temp directory too, through TMPDIR). matplotlib is not a project
dependency: install it into the virtualenv to run this.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

try:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import dates as mdates
    from matplotlib import pyplot as plt
    from matplotlib import ticker
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
except ImportError:  # reported by main() with a hint
    matplotlib = None

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # for tests.prom when run as a script

from tests.conftest import free_port  # noqa: E402
from tests.prom import PrometheusServer  # noqa: E402  (a real Prometheus, as the e2e tests start it)

DASHBOARD = REPO / "etc" / "grafana" / "sglang-supervisor.json"
DEMO_SERVER = "demo"  # the demo's server: its config is supervisor/sim/demo.toml, so its name is "demo"
DEFAULT_OUT = REPO / "docs" / "dashboard.png"
DEFAULT_SCRAPE_S = 0.1  # the demo's first READY lasts ~0.15 s: a 1 s scrape misses it
MARGIN_S = 3  # seconds of window before the demo starts and after it ends

WIDTH_PX, HEIGHT_PX, DPI = 1600, 1000, 100
HEADER_PX, FOOTER_PX, GAP_PX = 30, 12, 5
ROW_PX, PANEL_FIXED_PX = 17, 36  # a row header; a panel's title and tick labels
# Grafana's dark theme and its named colours.
BACKGROUND, PANEL, TEXT, FAINT, GRID = "#111217", "#181B1F", "#CCCCDC", "#8E8E8E", "#2C3235"
NAMED_COLORS = {
    "green": "#73BF69", "red": "#F2495C", "orange": "#FF9830", "blue": "#5794F2",
    "light-blue": "#8AB8FF", "yellow": "#FADE2A", "purple": "#B877D9", "text": "#9FA7B3",
}
PALETTE = ("#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9",
           "#705DA0", "#37872D", "#FADE2A")  # Grafana's classic palette
# What a reader of the picture would otherwise wonder about, in the panel's corner.
NOTES = {
    "Startup duration": "p50/p95 are interpolated inside the 1-5 s bucket; the mean is exact",
    "Health probe duration": "gaps: rate windows that hold none of the demo's probes (one a second)",
    "MQTT connected": "MQTT is off in the demo",
    "KV capacity (max_total_num_tokens)": "8 equal ranks: the lines overlap",
    "Per-rank free GPU memory after CUDA-graph capture": "8 equal ranks: the lines overlap",
    "GPU free memory": "8 equal GPUs: the lines overlap",
}
MISSING_HINT = "matplotlib is missing: .venv/bin/pip install matplotlib (only this script needs it)"


# -- the scrape -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """The demo's window (Unix seconds): range queries cover it at ``step``; stats read ``snapshot``."""

    start: float
    end: float
    snapshot: float
    step: float

    def grid(self) -> list[float]:
        return [self.start + k * self.step for k in range(round((self.end - self.start) / self.step) + 1)]

    def index(self, t: float) -> int:
        return round((t - self.start) / self.step)

    @property
    def rate_interval(self) -> float:
        """Grafana's ``$__rate_interval``: max($__interval + scrape interval, 4 x scrape interval)."""
        return 4 * self.step  # the step is the scrape interval


def duration(seconds: float) -> str:
    """A PromQL duration in whole milliseconds."""
    return f"{max(1, round(seconds * 1000))}ms"


@dataclass(frozen=True, slots=True)
class Series:
    """One result series of a query: its labels and its values on the window's grid (NaN = none)."""

    labels: dict[str, str]
    values: list[float]


@contextlib.contextmanager
def demo(hold: float, metrics_port: int, workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``supervisor.cli demo`` in a session of its own; SIGTERM (then SIGKILL) if it outlives the block."""
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "supervisor.cli", "demo", "--hold", f"{hold:g}",
        "--set", f'metrics.listen="127.0.0.1:{metrics_port}"',
        "--set", f"server.port={free_port()}",
        "--set", f"state.dir={workdir / 'state'}",
    ]
    env = {**os.environ, "TMPDIR": str(workdir)}  # the demo's mkdtemp lands here, and is removed with it
    with open(workdir / "demo.log", "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the daemon stops its simulated server on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def substitute(expr: str, window: Window, at: float) -> str:
    """The expression with Grafana's variables as Grafana would fill them for this window."""
    variables = {
        "$__rate_interval": duration(window.rate_interval),
        "$__interval": duration(window.step),
        "$__range": duration(at - window.start),
        "$instance": ".*",
        # the demo's one server: every server (=~), and its repeated row (one server, =)
        'server=~"$server"': 'server=~".*"',
        'server="$server"': f'server="{DEMO_SERVER}"',
    }
    for name, value in variables.items():
        expr = expr.replace(name, value)
    return expr


def number(text: str) -> float:
    """A sample value; infinities (a quantile beyond the last bucket) are not drawable: NaN."""
    value = float(text)
    return value if math.isfinite(value) else math.nan


def fetch(prom: PrometheusServer, target: dict[str, Any], window: Window) -> list[Series]:
    """A panel target's series: an instant query at the snapshot, or a range query over the window."""
    if target.get("instant"):
        expr = substitute(target["expr"], window, window.snapshot)
        result = prom.api("query", query=expr, time=f"{window.snapshot:.3f}")["result"]
        return [Series(r["metric"], [number(r["value"][1])]) for r in result]
    expr = substitute(target["expr"], window, window.end)
    result = prom.api("query_range", query=expr, start=f"{window.start:.3f}", end=f"{window.end:.3f}",
                      step=f"{window.step:g}")["result"]
    series = []
    for r in result:
        values = [math.nan] * len(window.grid())
        for t, v in r["values"]:
            values[window.index(float(t))] = number(v)
        series.append(Series(r["metric"], values))
    return series


def last_up(prom: PrometheusServer, start: float, end: float, step: float) -> float:
    """The last time the server was up in the window (the "Now" stats are read then), else ``end``."""
    result = prom.api("query_range", query="sglang_supervisor_server_up == 1",
                      start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")["result"]
    times = [float(t) for r in result for t, _ in r["values"]]
    return max(times, default=end)


def scraped_gone_after(prom: PrometheusServer, when: float) -> bool:
    """Prometheus has found the demo's endpoint gone (``up`` 0) at a scrape later than ``when``."""
    return any(float(r["value"][1]) > when for r in prom.query("timestamp(up == 0)"))


PanelData = list[tuple[dict[str, Any], list[Series]]]


def scrape(
    prometheus: str, dashboard: dict[str, Any], hold: float, scrape_s: float, workdir: Path
) -> tuple[Window, dict[int, PanelData]]:
    """Run the demo under a scraping Prometheus and query every panel; everything is stopped after."""
    metrics_port = free_port()
    prom = PrometheusServer(prometheus, workdir / "prometheus", [f"127.0.0.1:{metrics_port}"],
                            scrape_interval=duration(scrape_s))
    prom.start(timeout=120)
    try:
        started = time.time()
        with demo(hold, metrics_port, workdir / "demo") as proc:
            try:
                code = proc.wait(timeout=hold + 300)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                log = (workdir / "demo" / "demo.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"the demo did not end well (exit {code}); no picture.\n{log}")
        start, end = math.floor(started) - MARGIN_S, math.ceil(time.time()) + MARGIN_S
        # Prometheus has scraped past the window's end: the demo's endpoint is gone by then.
        prom.wait_for(lambda: scraped_gone_after(prom, end), 60, "a scrape after the window's end")
        window = Window(start, end, last_up(prom, start, end, scrape_s), scrape_s)
        data = {
            panel["id"]: [(target, fetch(prom, target, window)) for target in panel["targets"]]
            for panel in dashboard["panels"] if panel["type"] != "row"
        }
    finally:
        prom.stop()
    return window, data


# -- formatting ---------------------------------------------------------------------------------


def legend(target: dict[str, Any], series: Series) -> str:
    """The target's legendFormat with ``{{label}}`` filled in, or the series' labels."""
    fmt = target.get("legendFormat") or ""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: series.labels.get(m.group(1), ""), fmt)
    labels = ", ".join(f'{k}="{v}"' for k, v in sorted(series.labels.items()) if k not in ("job", "instance"))
    return f"{{{labels}}}" if labels else target["expr"][:40]


def scale_for(unit: str | None, values: Sequence[float]) -> tuple[float, str]:
    """A divisor and a suffix that print ``values`` in ``unit`` as Grafana would (bytes: IEC)."""
    peak = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    if unit == "bytes":
        steps = ((1024.0**4, " TiB"), (1024.0**3, " GiB"), (1024.0**2, " MiB"), (1024.0, " KiB"), (1.0, " B"))
    elif unit == "short":
        steps = ((1e9, " Bil"), (1e6, " Mil"), (1e3, " K"), (1.0, ""))
    else:
        return 1.0, (" s" if unit == "s" else "")
    return next(((size, suffix) for size, suffix in steps if peak >= size), steps[-1])


def format_value(value: float, unit: str | None, decimals: int | None = None, now: float | None = None) -> str:
    """A value in the panel's unit, roughly as Grafana prints it."""
    if math.isnan(value):
        return "NaN"
    if unit == "dateTimeFromNow":  # milliseconds since the epoch
        ago = f" ({now - value / 1000:.0f} s before)" if now is not None else ""
        return f"{datetime.fromtimestamp(value / 1000, UTC):%H:%M:%S} UTC{ago}"
    divisor, suffix = scale_for(unit, [value])
    scaled = value / divisor
    return (f"{scaled:.{decimals}f}" if decimals is not None else f"{scaled:.3g}") + suffix


def mapped(value: float, defaults: dict[str, Any]) -> tuple[str | None, str | None]:
    """The (text, colour) a value mapping gives a value, else (None, a threshold colour or None)."""
    if math.isfinite(value) and value == int(value):
        for mapping in defaults.get("mappings", []):
            option = mapping.get("options", {}).get(str(int(value))) if mapping.get("type") == "value" else None
            if option:
                return option.get("text"), NAMED_COLORS.get(option.get("color", ""), option.get("color"))
    color = None
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step["value"] is None or (not math.isnan(value) and value >= step["value"]):
            color = NAMED_COLORS.get(step["color"], step["color"])
    return None, color


# -- drawing ------------------------------------------------------------------------------------


def defaults_of(panel: dict[str, Any]) -> dict[str, Any]:
    return panel.get("fieldConfig", {}).get("defaults", {})


def named(data: PanelData) -> list[tuple[str, Series]]:
    """Every series of a panel with its legend."""
    return [(legend(target, s), s) for target, series in data for s in series]


def overrides(panel: dict[str, Any], name: str) -> dict[str, Any]:
    """Line style and colour a panel's byName overrides give a series."""
    style: dict[str, Any] = {}
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        if override["matcher"] == {"id": "byName", "options": name}:
            for prop in override["properties"]:
                if prop["id"] == "custom.lineStyle" and prop["value"].get("fill") == "dash":
                    style["linestyle"] = (0, (4, 3))
                elif prop["id"] == "color":
                    fixed = prop["value"].get("fixedColor")
                    style["color"] = NAMED_COLORS.get(fixed, fixed)
    return style


def no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "No data", ha="center", va="center", color=FAINT, fontsize=9, transform=ax.transAxes)


def draw_stat(ax: Axes, panel: dict[str, Any], data: PanelData, window: Window) -> None:
    """Grafana's stat panel: each series' name and value side by side, coloured by value."""
    defaults = defaults_of(panel)
    cells = [(name, s.values[-1]) for name, s in named(data)]
    ax.set_axis_off()
    if not cells:
        no_data(ax)
    width = 1 / max(1, len(cells))
    for i, (name, value) in enumerate(cells):
        text, color = mapped(value, defaults)
        if text is None:
            text = format_value(value, defaults.get("unit"), defaults.get("decimals"), window.snapshot)
        if panel.get("options", {}).get("colorMode") == "background" and color:
            ax.add_patch(Rectangle((i * width + 0.01, 0), width - 0.02, 1, color=color, transform=ax.transAxes))
        center = (i + 0.5) * width
        ax.text(center, 0.82, name, ha="center", va="center", fontsize=6.5, color=TEXT, transform=ax.transAxes)
        ax.text(center, 0.36, text, ha="center", va="center", fontsize=14 if len(text) <= 8 else 8.5,
                color="white", weight="bold", transform=ax.transAxes)


def draw_bargauge(ax: Axes, panel: dict[str, Any], data: PanelData, window: Window) -> None:
    """Grafana's horizontal bar gauge: one bar per series, its value at the end."""
    defaults = defaults_of(panel)
    cells = [(name, s.values[-1]) for name, s in named(data)]
    if not cells:
        ax.set_axis_off()
        no_data(ax)
        return
    names, values = zip(*cells, strict=True)
    ax.barh(range(len(values)), values, color=PALETTE[: len(values)], height=0.6)
    ax.set_yticks(range(len(values)), names, fontsize=7)
    ax.set_xlim(0, max(values) * 1.2)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(5, integer=True))
    for i, value in enumerate(values):
        ax.text(value, i, f" {format_value(value, defaults.get('unit'), defaults.get('decimals'))}", va="center",
                fontsize=8, color=TEXT)
    ax.set_ylim(len(values) - 0.5, -0.5)


def time_axis(ax: Axes, window: Window) -> list[datetime]:
    """The shared time axis (UTC clock time); the window's grid as datetimes."""
    times = [datetime.fromtimestamp(t, UTC) for t in window.grid()]
    ax.set_xlim(times[0], times[-1])
    ax.xaxis.set_major_locator(mdates.SecondLocator(bysecond=range(0, 60, 5)))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=UTC))
    return times


def runs(values: Sequence[float]) -> list[tuple[int, int, float]]:
    """Runs of equal values, NaN breaking them: (first index, last index + 1, value)."""
    found: list[tuple[int, int, float]] = []
    for i, value in enumerate(values):
        if math.isnan(value):
            continue
        if found and found[-1][1] == i and found[-1][2] == value:
            found[-1] = (found[-1][0], i + 1, value)
        else:
            found.append((i, i + 1, value))
    return found


def draw_state_timeline(ax: Axes, panel: dict[str, Any], data: PanelData, window: Window) -> None:
    """Grafana's state timeline: one band per series, merged runs of equal values, mapped text and colour."""
    defaults = defaults_of(panel)
    times = time_axis(ax, window)
    nums = [mdates.date2num(t) for t in times] + [mdates.date2num(times[-1]) + window.step / 86400]
    bands = named(data)
    if not bands:
        no_data(ax)
    for row, (_, series) in enumerate(bands):
        for first, stop, value in runs(series.values):
            text, color = mapped(value, defaults)
            label = text or format_value(value, defaults.get("unit"))
            span = nums[stop] - nums[first]
            ax.broken_barh([(nums[first], span)], (row - 0.4, 0.8), color=color or PALETTE[0], edgecolor=PANEL,
                           linewidth=0.4)
            if span / (nums[-1] - nums[0]) * ax.bbox.width > 5.5 * len(label) + 4:  # the label fits
                ax.text(nums[first] + span / 2, row, label, ha="center", va="center", fontsize=6.5, color="black")
    ax.set_yticks(range(len(bands)), [name for name, _ in bands], fontsize=6.5)
    ax.set_ylim(max(len(bands), 1) - 0.5, -0.5)


def draw_timeseries(ax: Axes, panel: dict[str, Any], data: PanelData, window: Window) -> None:
    """Grafana's time series: lines (stepped if the panel says so) or stacked bars, legend on the right."""
    defaults = defaults_of(panel)
    custom = defaults.get("custom", {})
    times = time_axis(ax, window)
    lines = named(data)
    every = [v for _, s in lines for v in s.values if math.isfinite(v)]
    divisor, suffix = scale_for(defaults.get("unit"), every)
    if not every:
        no_data(ax)
    bottom = [0.0] * len(times)
    for n, (name, series) in enumerate(lines):
        style = {"color": PALETTE[n % len(PALETTE)], **overrides(panel, name)}
        values = [v / divisor for v in series.values]
        if custom.get("drawStyle") == "bars":
            heights = [v if math.isfinite(v) else 0.0 for v in values]
            ax.bar(times, heights, bottom=bottom, width=window.step / 86400, align="edge", label=name,
                   color=style["color"])
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        elif custom.get("lineInterpolation") == "stepAfter":
            ax.step(times, values, where="post", label=name, linewidth=1.2, **style)
        else:
            ax.plot(times, values, label=name, linewidth=1.2, **style)
    locator = ticker.MaxNLocator(4, steps=[1, 2, 2.5, 5, 10])
    if every and not any(every):  # all zero: 0 at the bottom, as Grafana draws it
        ax.set_ylim(0, 1)
        locator = ticker.FixedLocator([0, 1])
    ax.yaxis.set_major_locator(locator)
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    ax.grid(True, color=GRID, linewidth=0.5)
    if lines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=6, frameon=False, labelcolor=TEXT,
                  ncol=legend_columns(len(lines)), handlelength=1.2, borderaxespad=0, columnspacing=0.8,
                  labelspacing=0.25)


def legend_columns(entries: int) -> int:
    return 1 if entries <= 5 else 2


def fit_legend(fig: Figure, ax: Axes, right_px: float) -> None:
    """Narrow the axes so that its right-hand legend ends at ``right_px``."""
    legend_box = ax.get_legend()
    if legend_box is None:
        return
    legend_px = legend_box.get_window_extent(fig.canvas.get_renderer()).width
    pos = ax.get_position()
    ax.set_position([pos.x0, pos.y0, (right_px - legend_px - 8) / WIDTH_PX - pos.x0, pos.height])


DRAW: dict[str, Callable[[Axes, dict[str, Any], PanelData, Window], None]] = {
    "stat": draw_stat,
    "bargauge": draw_bargauge,
    "state-timeline": draw_state_timeline,
    "timeseries": draw_timeseries,
}


# -- layout -------------------------------------------------------------------------------------


class Layout:
    """Grafana's 24-column grid on the figure, in pixels.

    Panels starting at the same grid y form a band (this dashboard is laid out in bands). A
    band is as tall as a fixed part (title, tick labels), like Grafana's panel header, plus
    its grid height times a unit that makes the bands fill the figure; row headers are thin.
    """

    def __init__(self, panels: Sequence[dict[str, Any]]) -> None:
        bands: dict[int, tuple[int, bool]] = {}
        for panel in panels:
            pos = panel["gridPos"]
            bands[pos["y"]] = (max(pos["h"], bands.get(pos["y"], (0, False))[0]), panel["type"] == "row")
        fixed = sum(ROW_PX if is_row else PANEL_FIXED_PX for _, is_row in bands.values())
        units = sum(h for h, is_row in bands.values() if not is_row)
        self.unit_px = (HEIGHT_PX - HEADER_PX - FOOTER_PX - fixed) / units
        self.top_px: dict[int, float] = {}
        cursor = float(HEADER_PX)
        for y in sorted(bands):
            self.top_px[y] = cursor
            h, is_row = bands[y]
            cursor += ROW_PX if is_row else PANEL_FIXED_PX + h * self.unit_px

    def box(self, panel: dict[str, Any]) -> tuple[float, float, float, float]:
        """(left, top, width, height) of a panel in pixels from the top left, gaps removed."""
        pos = panel["gridPos"]
        height = ROW_PX if panel["type"] == "row" else PANEL_FIXED_PX + pos["h"] * self.unit_px
        return (pos["x"] / 24 * WIDTH_PX + GAP_PX / 2, self.top_px[pos["y"]] + GAP_PX / 2,
                pos["w"] / 24 * WIDTH_PX - GAP_PX, height - GAP_PX)


def figure_rect(left: float, top: float, width: float, height: float) -> list[float]:
    """A pixel box (from the top left) as matplotlib's figure fractions (from the bottom left)."""
    return [left / WIDTH_PX, 1 - (top + height) / HEIGHT_PX, width / WIDTH_PX, height / HEIGHT_PX]


def margins(panel: dict[str, Any], data: PanelData) -> tuple[float, float, float, float]:
    """Pixels (left, right, top, bottom) around a panel's plot: tick labels, the legend, the title."""
    names = [name for name, _ in named(data)]
    longest = max((len(n) for n in names), default=0)
    kind = panel["type"]
    if kind == "stat":
        return 4, 4, 17, 4
    if kind == "bargauge":
        return 14 + 4.6 * longest, 40, 19, 14
    if kind == "state-timeline":
        return 12 + 5 * longest, 24, 19, 14
    return 50, 10, 19, 14  # the legend's room is made once it is drawn (fit_legend)


def style_axes(ax: Axes) -> None:
    ax.set_facecolor(PANEL)
    ax.tick_params(colors=FAINT, labelsize=6.5, length=2, pad=2)
    for spine in ax.spines.values():
        spine.set_visible(False)


def clock(t: float) -> str:
    return f"{datetime.fromtimestamp(t, UTC):%H:%M:%S}"


def render(dashboard: dict[str, Any], window: Window, data: dict[int, PanelData], out: Path) -> None:
    """Draw every panel where the dashboard puts it, with the caption, and save the PNG."""
    fig: Figure = plt.figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, facecolor=BACKGROUND)
    layout = Layout(dashboard["panels"])

    def text(x_px: float, y_px: float, s: str, **kw: Any) -> None:
        fig.text(x_px / WIDTH_PX, 1 - y_px / HEIGHT_PX, s, parse_math=False, **kw)

    for panel in dashboard["panels"]:
        left, top, width, height = layout.box(panel)
        if panel["type"] == "row":
            text(left, top + height / 2, panel["title"], color=TEXT, fontsize=8.5, weight="bold", va="center")
            continue
        fig.add_artist(Rectangle(figure_rect(left, top, width, height)[:2], width / WIDTH_PX, height / HEIGHT_PX,
                                 transform=fig.transFigure, color=PANEL, zorder=0))
        text(left + 6, top + 3, panel["title"], color=TEXT, fontsize=7.5, weight="bold", va="top")
        m_left, m_right, m_top, m_bottom = margins(panel, data[panel["id"]])
        plot = (left + m_left, top + m_top, width - m_left - m_right, height - m_top - m_bottom)
        ax = fig.add_axes(figure_rect(*plot))
        style_axes(ax)
        DRAW[panel["type"]](ax, panel, data[panel["id"]], window)
        fit_legend(fig, ax, left + width - 6)
        if panel["title"] in NOTES:
            text(left + width - 6, top + 4, NOTES[panel["title"]], color=FAINT, fontsize=6, ha="right", va="top",
                 style="italic")
    day = datetime.fromtimestamp(window.start, UTC)
    text(6, 6, dashboard["title"], color="white", fontsize=13, weight="bold", va="top")
    small = {"color": FAINT, "fontsize": 6.5, "ha": "right", "va": "top"}
    text(WIDTH_PX - 6, 5, "Not a Grafana screenshot: the dashboard's queries, run against a real Prometheus "
         "scraping the simulated demo (sglang-supervisor demo: no GPU, no SGLang) on "
         f"{day:%Y-%m-%d}, drawn with matplotlib.", **small)
    text(WIDTH_PX - 6, 17, f"{clock(window.start)}-{clock(window.end)} UTC; scrape interval = step = $__interval = "
         f"{duration(window.step)} (the demo compresses the night), "
         f"$__rate_interval = {duration(window.rate_interval)}; stats and bar gauge at {clock(window.snapshot)}, "
         "the last sample with the server up.", **small)
    text(WIDTH_PX - 6, HEIGHT_PX - 4, "regenerate: .venv/bin/python scripts/render_dashboard.py",
         **{**small, "fontsize": 6, "va": "bottom"})
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, facecolor=BACKGROUND)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Scrape the demo, render the PNG; 2 when matplotlib or prometheus is missing."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG (default: docs/dashboard.png)")
    parser.add_argument("--hold", type=float, default=20.0, help="the demo's --hold: serving after the night (s)")
    parser.add_argument("--scrape-interval", type=float, default=DEFAULT_SCRAPE_S, metavar="SECONDS",
                        help="Prometheus's scrape interval and the queries' step (default: %(default)s)")
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "/usr/bin/prometheus")
    args = parser.parse_args(argv)
    if matplotlib is None:
        print(MISSING_HINT, file=sys.stderr)
        return 2
    if not os.access(args.prometheus, os.X_OK):
        print(f"prometheus not found at {args.prometheus} (apt-get install prometheus, or --prometheus PATH)",
              file=sys.stderr)
        return 2
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:  # the row Grafana repeats per server, for the demo's one
        panel["title"] = panel["title"].replace("$server", DEMO_SERVER)
    with tempfile.TemporaryDirectory(prefix="render-dashboard-") as tmp:
        print(f"running the demo (about {args.hold + 15:.0f} s) under a scraping Prometheus...", flush=True)
        window, data = scrape(args.prometheus, dashboard, args.hold, args.scrape_interval, Path(tmp))
    render(dashboard, window, data, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
