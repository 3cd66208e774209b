"""The night as a picture, drawn with matplotlib (the ``[report]`` extra; never the daemon's).

Per server, three rows sharing the time axis:

- the state: a band per state (READY green, BACKOFF orange, ...);
- ``mem_fraction_static`` as a step line over the state bands, the ladder's floor dashed, a
  red cross for each crash labelled with its cause, a triangle for each restart with its remedy,
  a green up-arrow for each climb (with its KV tokens gained) and an orange down-arrow for each
  fall-back from a climb that failed on probation;
- the free memory of each GPU rank (the least in each sample period, from the ring).

Only ``matplotlib.figure.Figure`` and the Agg canvas: no pyplot, no global state, no display.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from datetime import datetime, tzinfo
from typing import Any

from supervisor.core.night import Night
from supervisor.report import ServerNight
from supervisor.report.crashes import zone_label
from supervisor.sinks.gpuring import Ring

STATE_COLOURS = {
    "READY": "#2ca02c",
    "STARTING": "#1f77b4",
    "PREPARING": "#9ecae1",
    "EXITED": "#d62728",
    "BACKOFF": "#ff7f0e",
    "RESTARTING": "#bcbd22",
    "STOPPING": "#7f7f7f",
    "STOPPED": "#d9d9d9",
    "GAVE_UP": "#3b0a0a",
    "WAITING": "#9467bd",
}
CRASH = "#d62728"
RESTART = "#6a3d9a"
FRACTION = "#08306b"
CLIMB = "#1a9850"
FELL_BACK = "#e66101"
CLIMB_MARKER = r"$\Uparrow$"  # not the restart's triangle
FELL_BACK_MARKER = r"$\Downarrow$"


def missing() -> str | None:
    """None when matplotlib is importable, else the one line saying how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "the report's picture needs matplotlib: pip install 'sglang-supervisor[report]' (or --format text)"
    return None


def _x(t: float, tz: tzinfo) -> float:
    from matplotlib import dates

    return float(dates.date2num(datetime.fromtimestamp(t, tz)))


def draw(fig: Any, sn: ServerNight, tz: tzinfo, *, title: str) -> None:
    """Draw ``sn``'s night into ``fig`` (a Figure or SubFigure)."""
    from matplotlib import dates
    from matplotlib.patches import Patch

    n = sn.night
    grid = fig.add_gridspec(3, 1, height_ratios=[0.45, 3.0, 2.2], hspace=0.08)
    ax_state = fig.add_subplot(grid[0])
    ax_frac = fig.add_subplot(grid[1], sharex=ax_state)
    ax_gpu = fig.add_subplot(grid[2], sharex=ax_state)
    fig.suptitle(title, fontsize=12, fontweight="bold", x=0.01, y=1.02, ha="left")
    x0, x1 = _x(n.start, tz), _x(n.shown_end, tz)

    # the states
    used: dict[str, str] = {}
    for band in n.bands:
        colour = STATE_COLOURS.get(band.state, "#e377c2")
        used.setdefault(band.state, colour)
        a, b = _x(band.start, tz), _x(band.end, tz)
        ax_state.broken_barh([(a, b - a)], (0, 1), facecolors=colour)
        ax_frac.axvspan(a, b, color=colour, alpha=0.13, lw=0)
    ax_state.set_yticks([])
    ax_state.set_ylim(0, 1)
    ax_state.set_ylabel("state", rotation=0, ha="right", va="center")
    span = max(x1 - x0, 1e-9)

    # the fraction, crashes, climbs and fall-backs, restarts
    if n.fraction_steps:
        xs = [_x(t, tz) for t, _ in n.fraction_steps] + [x1]
        ys = [f for _, f in n.fraction_steps] + [n.fraction_steps[-1][1]]
        ax_frac.step(xs, ys, where="post", color=FRACTION, lw=2.2, label="mem_fraction_static")
    values = [f for _, f in n.fraction_steps] + ([n.floor] if n.floor is not None else [])
    values += [c.fraction for c in n.climbs if c.kind in ("climb", "fell_back") and c.fraction is not None]
    if n.floor is not None:
        ax_frac.axhline(n.floor, color="#636363", ls="--", lw=1, label=f"ladder floor {n.floor:g}")
    lo, hi = (min(values), max(values)) if values else (0.8, 0.95)
    pad = max((hi - lo) * 0.35, 0.02)
    ax_frac.set_ylim(lo - pad, hi + pad)
    labels = _Labels(ax_frac, x0, span, lo - pad, hi + pad)
    for m in n.crash_markers:
        y = m.fraction if m.fraction is not None else (max(values) if values else 0.9)
        ax_frac.scatter([_x(m.t, tz)], [y], marker="X", s=140, color=CRASH, zorder=5, edgecolors="white")
        labels.put(f"crash: {m.label}", _x(m.t, tz), y, 10, color=CRASH, fontweight="bold")
    climb_markers(ax_frac, labels, n, tz, max(values) if values else 0.9)
    for (t, f), (_, prev) in zip(n.fraction_steps[1:], n.fraction_steps[:-1], strict=False):
        if f != prev:
            labels.put(f"{prev:g} → {f:g}", _x(t, tz), f, -14, color=FRACTION)
    for m in n.restart_markers:
        y = m.fraction if m.fraction is not None else (min(values) if values else 0.9)
        ax_frac.scatter([_x(m.t, tz)], [y], marker="^", s=110, color=RESTART, zorder=5, edgecolors="white")
        labels.put(m.label, _x(m.t, tz), y, -26, color=RESTART)
    ax_frac.set_ylabel("mem_fraction_static")
    ax_frac.grid(axis="y", alpha=0.3)
    # one legend row above the state band: the states, then the lines (clear of the labels)
    lines, names = ax_frac.get_legend_handles_labels()
    handles = [Patch(color=c, label=s) for s, c in used.items()] + lines
    ax_state.legend(handles=handles, labels=[*used, *names], loc="lower left", bbox_to_anchor=(0, 1.02),
                    ncol=min(len(handles), 6), fontsize=8, frameon=False)

    # free GPU memory per rank
    ring = sn.ring
    if ring is not None and ring.times:
        xs = [_x(t, tz) for t in ring.times]
        palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                   "#bcbd22", "#7f7f7f"]
        series = gpu_series(ring)
        for k, (label, ys) in enumerate(series):
            ax_gpu.plot(xs, ys, color=palette[k % len(palette)], lw=1.6, alpha=0.85, label=label,
                        drawstyle="steps-post")
        ax_gpu.legend(loc="upper right", fontsize=7, ncol=min(len(series), 8))
        ax_gpu.set_ylim(bottom=0)
    else:
        ax_gpu.text(0.5, 0.5, "no GPU memory samples in the state directory", transform=ax_gpu.transAxes,
                    ha="center", va="center", color="#636363")
    ax_gpu.set_ylabel("free GPU memory, GB")
    ax_gpu.grid(alpha=0.3)
    ax_gpu.set_xlim(x0, x1)
    ax_gpu.set_xlabel(f"time ({zone_label(tz, n.end)})")
    locator = dates.AutoDateLocator(tz=tz)
    ax_gpu.xaxis.set_major_locator(locator)
    ax_gpu.xaxis.set_major_formatter(dates.ConciseDateFormatter(locator, tz=tz))
    for ax in (ax_state, ax_frac):
        ax.tick_params(labelbottom=False)


class _Labels:
    """The labels of the fraction's row, each right of its marker (left of it in the last
    third, clear of the edge), moved up or down by a line while it would overlap one placed
    before (the first placed keeps its place: crashes, then climbs, steps and restarts). The
    boxes are estimated in axes fractions from the text's length: no renderer needed."""

    AXES_PT = (670.0, 187.0)  # the fraction row of a 12 x 6.6 in figure, in points
    CHAR_PT = 6.2  # a 9 pt DejaVu Sans character, bold or not, on average
    LINE_PT = 12.0

    def __init__(self, ax: Any, x0: float, span: float, y0: float, y1: float) -> None:
        self.ax, self.x0, self.span, self.y0, self.dy = ax, x0, span, y0, max(y1 - y0, 1e-9)
        self.boxes: list[tuple[float, float, float]] = []  # (left, right, baseline) in axes fractions

    def put(self, text: str, x: float, y: float, dy: float, **style: Any) -> None:
        right = (x - self.x0) / self.span < 0.66
        xf = (x - self.x0) / self.span + (6 if right else -6) / self.AXES_PT[0]
        width = len(text) * self.CHAR_PT / self.AXES_PT[0]
        a, b = (xf, xf + width) if right else (xf - width, xf)
        at = (y - self.y0) / self.dy
        line = self.LINE_PT / self.AXES_PT[1]
        away = 1 if dy >= 0 else -1  # first further from the line, then towards it and past it

        def free(offset: float) -> bool:
            yf = at + offset / self.AXES_PT[1]
            inside = 0.02 <= yf <= 0.95
            return inside and not any(a < pb and pa < b and abs(yf - py) < line for pa, pb, py in self.boxes)

        tries = [dy, *(dy + k * self.LINE_PT * away for k in (1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6, 7, -7))]
        same_side = [o for o in tries if (o > 0) == (dy > 0)]  # above its marker if it was to be, else below
        dy = next((o for o in [*same_side, *tries] if free(o)), dy)
        self.boxes.append((a, b, at + dy / self.AXES_PT[1]))
        self.ax.annotate(text, (x, y), xytext=(6 if right else -6, dy), textcoords="offset points",
                         ha="left" if right else "right", fontsize=9, **style)


def climb_markers(ax: Any, labels: _Labels, n: Night, tz: tzinfo, default_y: float) -> None:
    """A climb at the fraction it went to (up), a fall-back at the one it fell back to (down),
    each labelled; one legend entry each."""
    labelled: set[str] = set()
    for c in n.climbs:
        if c.kind not in ("climb", "fell_back"):
            continue
        y = c.fraction if c.fraction is not None else default_y
        x = _x(c.t, tz)
        if c.kind == "climb":
            ax.scatter([x], [y], marker=CLIMB_MARKER, s=260, color=CLIMB, zorder=6,
                       label=None if c.kind in labelled else "climb")
            gain = f": {c.gain * 100:+.0f} % KV tokens" if c.gain is not None else ""
            labels.put(f"climb{gain}", x, y, 24, color=CLIMB, fontweight="bold")
        else:
            ax.scatter([x], [y], marker=FELL_BACK_MARKER, s=260, color=FELL_BACK, zorder=6,
                       label=None if c.kind in labelled else "fall-back")
            failed = f": {c.before:g} failed on probation" if c.before is not None else ""
            labels.put(f"fell back{failed}", x, y, -40, color=FELL_BACK, fontweight="bold")
        labelled.add(c.kind)


def gpu_series(ring: Ring) -> list[tuple[str, list[float]]]:
    """(legend label, free GB per record) per GPU; GPUs whose whole night is the same line
    (tensor-parallel ranks often are) share one, labelled with all of them ("GPU 0-7"),
    rather than hiding each other under the last one drawn."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, index in enumerate(ring.indices):
        groups.setdefault(tuple(row[k] for row in ring.free_mib), []).append(index)
    out = []
    for values, indices in groups.items():
        run = len(indices) > 2 and indices == list(range(indices[0], indices[0] + len(indices)))
        label = f"GPU {indices[0]}–{indices[-1]}" if run else "GPU " + ", ".join(map(str, indices))
        out.append((label, [v / 1024 for v in values]))
    return out


def figure(nights: Sequence[ServerNight], tz: tzinfo, titles: Sequence[str]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 6.6 * len(nights)), dpi=100)
    several: Any = fig.subfigures(len(nights), 1) if len(nights) > 1 else None  # an array of SubFigure
    subs = [fig] if several is None else list(several)
    for sub, sn, title in zip(subs, nights, titles, strict=True):
        draw(sub, sn, tz, title=title)
    return fig


def png(nights: Sequence[ServerNight], tz: tzinfo, titles: Sequence[str], *, dpi: int = 100) -> bytes:
    """The chart(s) as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure(nights, tz, titles)
    FigureCanvasAgg(fig)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=dpi, bbox_inches="tight")
    return out.getvalue()
