"""The report's crash table and header, for the person reading them (issue 33, item 11).

The night is written through the real journal and GPU ring sinks; its crash event carries
what the real diagnosis read from a real-shaped SGLang log (a CUDA OOM in
``deepseek_v2.py:2919 forward`` on TP3, PyTorch's whole message as the evidence line), and
its launches what the daemon now records (the GPUs' names, the SGLang version, the argv with
its secret redacted). The text and the HTML say it in words; headless Chromium renders the
crash table's location cell; no cell is cut inside a word, and no ``None`` or ``null`` shows
in a night whose records lack most fields.
"""

from __future__ import annotations

import html.parser
import re
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from harness import REPO
from test_report import chromium, dom_after, visible_text

from supervisor.core import events as ev
from supervisor.core.diagnosis import diagnose
from supervisor.core.model import ExitStatus, Phase, State
from supervisor.sinks.gpuring import GpuRingSink
from supervisor.sinks.journal import JournalSink

T0 = 1_764_460_800.0  # 2025-11-30 00:00 UTC: 01:00 in Europe/Berlin (CET)
TS = "[2025-11-30 00:59:59 TP3] "
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of "
       "139.81 GiB of which 1.19 GiB is free. Including non-PyTorch memory, this process has 138.60 GiB memory in "
       "use. Of the allocated memory 131.02 GiB is allocated by PyTorch, and 5.91 GiB is reserved by PyTorch but "
       "unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
LOG = "\n".join([
    TS + "Scheduler hit an exception: Traceback (most recent call last):",
    '  File "/sgl/srt/managers/scheduler.py", line 1010, in event_loop_overlap',
    "    batch_result = self.run_batch(batch)",
    '  File "/sgl/srt/models/deepseek_v2.py", line 2919, in forward',
    "    hidden_states = self.model(input_ids, positions, forward_batch)",
    OOM,
    "[2025-11-30 01:00:01] SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
])
ARGV = ("/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/DeepSeek-V3", "--tp-size", "8",
        "--mem-fraction-static", "0.93", "--api-key", "s3cret")
GPUS = ("NVIDIA H200",) * 8


def _night(state: Path, *, bare: bool = False) -> None:
    """A launch at 0.93, READY, the CUDA OOM at 01:00 UTC, the relaunch at 0.88 2.1 s later,
    READY. ``bare``: the same night as an older daemon (or a cut record) leaves it: no GPUs,
    no version, no argv, a crash with no location, rank, evidence or next fraction."""
    t = [T0]
    journal = JournalSink(state, clock=lambda: t[0])
    ring = GpuRingSink(state, sample_s=60, keep_days=1, clock=lambda: t[0])

    def at(dt: float, event: ev.Event) -> None:
        t[0] = T0 - 3600 + dt
        journal.emit(event)
        ring.emit(ev.GpuSample(gpus=tuple({"index": i, "total_bytes": 140 << 30, "free_bytes": 3 << 30}
                                          for i in range(8))))

    def changed(dt: float, frm: State, to: State, fraction: float | None) -> None:
        at(dt, ev.StateChanged(from_=frm, to=to, reason="r", mem_fraction_static=fraction, hicache_size_gb=None,
                               restarts=0, last_cause=None))

    def launch(dt: float, fraction: float | None, attempt: int) -> None:
        at(dt, ev.ServerLaunched(argv=() if bare else ARGV, mem_fraction_static=fraction, hicache_size_gb=None,
                                 attempt=attempt, pid=attempt, rung=None, launch_id=f"l{attempt}",
                                 gpus=() if bare else GPUS, sglang_version="" if bare else "0.5.6"))

    d = diagnose(LOG, exit_status=ExitStatus(code=None, signal=9), phase=Phase.SERVING)
    assert d.location == "deepseek_v2.py:2919 forward" and d.rank == "TP3", d  # what the real diagnosis reads
    changed(0, State.STOPPED, State.STARTING, None if bare else 0.93)
    launch(1, None if bare else 0.93, 1)
    changed(120, State.STARTING, State.READY, None if bare else 0.93)
    at(3600, ev.Crash(
        cause=d.cause, remedy=d.remedy, phase=d.phase, exit_code=None, signal=9,
        evidence=() if bare else d.evidence, evidence_lineno=None if bare else d.evidence_lineno,
        location=None if bare else d.location, rank=None if bare else d.rank,
        exc_type=None if bare else d.exc_type, exc_message=None, mem_fraction_static=None if bare else 0.93,
        hicache_size_gb=None, attempt=1, next_mem_fraction_static=None if bare else 0.88, next_hicache_size_gb=None,
        next_retry_s=2.0, consecutive_failures=1, runner_up=None, min_fraction=None, part_died=None,
        unrecognised=None, killed=None))
    changed(3600, State.READY, State.BACKOFF, None if bare else 0.88)
    launch(3602.1, None if bare else 0.88, 2)
    changed(3720, State.STARTING, State.READY, None if bare else 0.88)
    journal.close()
    ring.close()


def _config(tmp_path: Path, *, bare: bool = False):
    from supervisor.core.config import load_config

    state = tmp_path / ("bare" if bare else "night")
    _night(state, bare=bare)
    config = tmp_path / f"{state.name}.toml"
    config.write_text(f'[server]\nname = "kimi"\nmodel_path = "m"\n[state]\ndir = "{state}"\n'
                      '[report]\ntimezone = "Europe/Berlin"\n')
    return load_config(str(config))


def _write(tmp_path: Path, fmt: str, *, bare: bool = False) -> str:
    from supervisor.cli.report import write_report

    path = write_report(_config(tmp_path, bare=bare), fmt=fmt, output=str(tmp_path / f"night.{fmt}"),
                        since_s=12 * 3600, now=T0 + 1800)
    assert path is not None
    return path.read_text()


def test_the_crash_table_and_header_in_words(tmp_path):
    """The text report: SGLang 0.5.6, 8 × NVIDIA H200, the launch command with its secret
    redacted; a crash block with the local time and its zone, the rank, the cause, the
    location, PyTorch's whole line and "fraction 0.93 → 0.88, relaunched in 2.1 s"."""
    out = _write(tmp_path, "text")
    assert "SGLang          0.5.6" in out
    assert "8 × NVIDIA H200 (140 GB each)" in out
    assert "--mem-fraction-static 0.93 --api-key '***'" in out and "s3cret" not in out
    block = out.split("Crashes (1):\n", 1)[1].split("\n\n", 1)[0]
    cells = dict(re.findall(r"^  (\S.*?)\s{2,}(.*(?:\n {20,}.*)*)", block, re.M))
    said = {k: " ".join(v.split()) for k, v in cells.items()}
    assert said["time (Europe/Berlin, CET)"] == "01:00:00"  # 00:00 UTC
    assert said["server"] == "kimi" and said["rank"] == "TP3"
    assert said["cause"] == "a CUDA OOM while serving (cuda_oom_runtime, torch.OutOfMemoryError)"
    assert said["where (file:line function)"] == "deepseek_v2.py:2919 forward"
    assert said["the log's line"] == f"line 6: {OOM}"  # whole, wrapped at spaces
    assert said["what it did next"] == "fraction 0.93 → 0.88, relaunched in 2.1 s"
    assert "01:00:00  crash: cuda_oom_runtime (serving) at 0.93, next at 0.88; torch.OutOfMemoryError" in out
    assert "The night (times Europe/Berlin, CET):" in out


class _Cells(html.parser.HTMLParser):
    """Each table cell's text, by its table's class."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[tuple[str, str]] = []
        self._table = ""
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._table = dict(attrs).get("class") or ""
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append((self._table, " ".join("".join(self._cell).split())))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _words(text: str) -> set[str]:
    """The words of ``text``, and the parts of each snake_case name."""
    words = set(re.findall(r"[A-Za-z][A-Za-z_]{2,}", text))
    return words | {part for w in words for part in w.split("_") if part}


def test_no_cell_is_cut_inside_a_word(tmp_path):
    """Every cell of every table of the page ends on a whole word: no cell's last word is a
    mere beginning of a word the night's records hold (the cut "non-PyTor" of "non-PyTorch")."""
    page = _write(tmp_path, "html")
    parser = _Cells()
    parser.feed(page)
    assert {t for t, _ in parser.cells} >= {"about", "crashes"}
    records = (tmp_path / "night" / "journal.jsonl").read_text()
    source = _words(records) | _words(OOM)
    own = set().union(*(_words(f.read_text()) for f in (REPO / "supervisor" / "report").glob("*.py")))  # its words
    cut = []
    for table, cell in parser.cells:  # a cut ends a cell, or comes before the "…" that marks it
        ends = [m.group(1) for m in re.finditer(r"([A-Za-z][A-Za-z_]{2,})\W*(?:…|$)", cell)]
        for word in ends:
            if word not in source | own and any(w.startswith(word) and w != word for w in source):
                cut.append((table, word, cell[-80:]))
    assert len(parser.cells) > 40 and not cut, cut
    crashes = [cell for table, cell in parser.cells if table == "crashes"]
    assert f"line 6: {OOM}" in crashes and "deepseek_v2.py:2919 forward" in crashes


@pytest.mark.parametrize("fmt", ["text", "html"])
def test_a_night_with_missing_fields_says_no_none(tmp_path, fmt):
    """An older daemon's night (no GPUs' names, no version, no argv; a crash without location,
    rank, evidence or fraction): the report says so in words, never "None" or "null"."""
    out = _write(tmp_path, fmt, bare=True)
    text = visible_text(out) if fmt == "html" else out
    assert not re.search(r"\bNone\b|\bnull\b", text), re.findall(r".{60}\b(?:None|null)\b.{20}", text)
    assert "not recorded" in text and "8 GPUs (140 GB each), model not recorded" in text
    assert "(no line in the server's log)" in text and "SGLang's default fraction, relaunched in 2.1 s" in text


def test_the_chart_says_its_time_zone(tmp_path):
    """The chart's time axis is labelled with the zone its ticks are in."""
    from supervisor.report import chart, collect

    berlin = ZoneInfo("Europe/Berlin")
    nights = collect(_config(tmp_path), since_s=12 * 3600, now=T0 + 1800, tz=berlin)
    fig = chart.figure(nights, berlin, ["night"])
    assert [ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()] == ["time (Europe/Berlin, CET)"]


@pytest.mark.integration
def test_the_crash_tables_location_cell_in_a_real_browser(tmp_path):
    """Headless Chromium renders the crash table: its location cell for the CUDA OOM reads
    "deepseek_v2.py:2919 forward", its evidence cell PyTorch's whole line, its remedy cell the
    step and the relaunch, and the header the version, the GPUs and the command."""
    browser = chromium()
    _write(tmp_path, "html")
    page = tmp_path / "night.html"
    dom = dom_after(browser, tmp_path, page.read_text(), (
        "const row = document.querySelector('table.crashes tr.crash-row');"
        "const p = document.createElement('pre'); p.id = 'cells';"
        "p.textContent = [...row.cells].map(c => c.className + '=' + c.innerText.replace(/\\s+/g, ' ')).join('\\n');"
        "document.body.appendChild(p);"))
    cells = dict(line.split("=", 1) for line in
                 re.search(r'<pre id="cells">(.*?)</pre>', dom, re.S).group(1).splitlines())  # type: ignore[union-attr]
    assert cells["where"] == "deepseek_v2.py:2919 forward"
    assert cells["rank"] == "TP3" and cells["t"] == "01:00:00"
    assert cells["evidence"].replace("&gt;", ">") == f"line 6: {OOM}"
    assert cells["remedy"] == "fraction 0.93 → 0.88, relaunched in 2.1 s"
    text = visible_text(dom)
    assert "SGLang 0.5.6 GPUs 8 × NVIDIA H200 (140 GB each) launch command /venv/bin/python -m sglang.launch_server" in text
    assert "time (Europe/Berlin, CET)" in text
