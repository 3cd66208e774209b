"""`sglang-supervisor report` as a person sees it.

The demo night (the OOM at 0.93, the relaunch at 0.88, READY) is run for real; its report is
opened in a real headless Chromium (Debian's ``chromium``; scripts/install-system-deps), which
dumps the DOM it rendered and takes a screenshot. The rendered text must name the crash, its
cause and the fraction's step; the chart's region of the screenshot must be a chart (many
distinct colours), not a blank or an error page. A missing Chromium fails the test.

``SGLANG_SUPERVISOR_UPDATE_DOCS=1`` also copies the screenshot to docs/report-demo.png (the
README's picture).
"""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port
from harness import REPO

from supervisor.core import events as ev
from supervisor.core.model import Cause, Phase, Remedy, State
from supervisor.sinks.gpuring import GpuRingSink
from supervisor.sinks.journal import JournalSink

WIDTH, HEIGHT = 1280, 1700


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("chromium is missing: scripts/install-system-deps installs Debian's chromium")


def headless(browser: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={tmp / 'chromium-profile'}", f"--window-size={WIDTH},{HEIGHT}", *args],
        capture_output=True, text=True, timeout=120,
    )


class _Text(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("style", "script")

    def handle_endtag(self, tag):
        self._skip -= tag in ("style", "script")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def visible_text(dom: str) -> str:
    parser = _Text()
    parser.feed(dom)
    return re.sub(r"\s+", " ", " ".join(parser.parts))


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.integration
def test_the_demo_nights_report_in_a_real_browser(tmp_path, no_leftovers):
    """Run the demo night, write its report, open it in headless Chromium: the DOM it rendered
    names the crash, cuda_oom_runtime and 0.93 -> 0.88; the chart region has many colours."""
    browser = chromium()
    demo = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "demo", "--hold", "10", "--set", f"server.port={free_port()}",
         "--set", "metrics.enabled=false", "--set", f'server.env={{SGLANG_SUPERVISOR_TEST_ID="{no_leftovers}", '
         'SGLANG_PYSPY_DUMP_BEFORE_CRASH="0", SGLANG_CUDA_COREDUMP_BEFORE_CRASH="0"}'],  # as etc/demo.toml has
        capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    state_dir = re.search(r"state in (\S+)", demo.stdout).group(1)  # type: ignore[union-attr]
    # `make demo` ends with the night's report and its path
    own = re.search(r"^the night's report: (\S+)$", demo.stdout, re.M)
    assert own and Path(own.group(1)).read_text().startswith("<!DOCTYPE html>"), demo.stdout
    page = tmp_path / "report.html"
    r = run_cli("report", "--config", str(REPO / "etc" / "demo.toml"), "--set", f"state.dir={state_dir}",
                "--set", f"gpu.sim_dir={tmp_path / 'gpus'}", "--since", "1h", "-o", str(page))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == page.resolve()
    source = page.read_text()
    assert "data:image/png;base64," in source
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", source), "the page must not fetch anything"

    # What Chromium rendered, and where it put the chart: a copy of the page with one script
    # that writes the image's box into the DOM (the page itself has no script).
    probe = tmp_path / "probe.html"
    probe.write_text(source.replace("</body>", (
        "<script>const r = document.querySelector('img.chart').getBoundingClientRect();"
        "const p = document.createElement('pre'); p.id = 'chart-box';"
        "p.textContent = JSON.stringify({x: r.x, y: r.y, w: r.width, h: r.height,"
        " loaded: document.querySelector('img.chart').naturalWidth});"
        "document.body.appendChild(p);</script></body>")))
    dumped = headless(browser, tmp_path, "--dump-dom", probe.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = dumped.stdout
    text = visible_text(dom)
    assert "cuda_oom_runtime" in text
    assert re.search(r"crash: cuda_oom_runtime \(serving\) at 0\.93, remedy fraction_down → 0\.88", text), text[:3000]
    assert "0.93 at the start → 0.88 at the end" in text
    assert "cuda_oom_runtime × 1" in text
    assert "258,992 at 0.93" in text and "at 0.88" in text  # KV tokens per rung
    box = json.loads(re.search(r'<pre id="chart-box">(.*?)</pre>', dom).group(1))  # type: ignore[union-attr]
    assert box["loaded"] > 0 and box["w"] > 600 and box["h"] > 300, box

    shot = tmp_path / "report.png"
    taken = headless(browser, tmp_path, f"--screenshot={shot}", page.as_uri())
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (WIDTH, HEIGHT)
        region = image.convert("RGB").crop((int(box["x"]), int(box["y"]), int(box["x"] + box["w"]),
                                            int(min(box["y"] + box["h"], HEIGHT))))
        colours = region.getcolors(maxcolors=1 << 20) or []
    assert len(colours) >= 200, f"the chart region has {len(colours)} distinct colours: blank or broken"
    # not one colour covering nearly all of it (a blank image has one)
    assert max(n for n, _ in colours) < 0.9 * region.size[0] * region.size[1]
    if os.environ.get("SGLANG_SUPERVISOR_UPDATE_DOCS"):
        shutil.copy(shot, REPO / "docs" / "report-demo.png")


def _journal_night(state: Path) -> None:
    """The demo night written through the real sinks, at fixed wall times."""
    t = [1_764_460_800.0]  # 2025-11-30 00:00 UTC
    clock = lambda: t[0]  # noqa: E731
    journal = JournalSink(state, clock=clock)
    ring = GpuRingSink(state, sample_s=60, keep_days=1, clock=clock)

    def at(dt: float, event: ev.Event, gpus_free_gb: float | None = None) -> None:
        t[0] = 1_764_460_800.0 + dt
        journal.emit(event)
        if gpus_free_gb is not None:
            ring.emit(ev.GpuSample(gpus=tuple({"index": i, "total_bytes": 96 << 30, "free_bytes": int(gpus_free_gb * (1 << 30))}
                                              for i in range(2))))

    def changed(dt: float, frm: State, to: State, fraction: float) -> None:
        at(dt, ev.StateChanged(from_=frm, to=to, reason="r", mem_fraction_static=fraction, hicache_size_gb=None,
                               restarts=0, last_cause=None))

    changed(0, State.STOPPED, State.STARTING, 0.93)
    at(1, ev.ServerLaunched(argv=("python",), mem_fraction_static=0.93, hicache_size_gb=None, attempt=1, pid=1,
                            rung=0, launch_id="a"), 96)
    changed(120, State.STARTING, State.READY, 0.93)
    for k in range(1, 60):
        at(120 + 60 * k, ev.GpuSample(gpus=()), 0.8 + (k % 3) * 0.1)
    at(3700, ev.Crash(cause=Cause.CUDA_OOM_RUNTIME, remedy=Remedy.FRACTION_DOWN, phase=Phase.SERVING, exit_code=None,
                      signal=9, evidence=("torch.OutOfMemoryError: CUDA out of memory.",), evidence_lineno=1,
                      location=None, rank="TP0", exc_type=None, exc_message=None, mem_fraction_static=0.93,
                      hicache_size_gb=None, attempt=1, next_mem_fraction_static=0.88, next_hicache_size_gb=None,
                      next_retry_s=2.0, consecutive_failures=1))
    changed(3700, State.READY, State.BACKOFF, 0.88)
    at(3702, ev.ServerLaunched(argv=("python",), mem_fraction_static=0.88, hicache_size_gb=None, attempt=2, pid=2,
                               rung=1, launch_id="b"), 96)
    changed(3820, State.STARTING, State.READY, 0.88)
    for k in range(1, 30):
        at(3820 + 60 * k, ev.GpuSample(gpus=()), 5.6)
    journal.close()
    ring.close()


def test_text_and_png_formats(tmp_path):
    """--format text prints the summary (no matplotlib needed); --format png writes a PNG chart."""
    state = tmp_path / "state"
    _journal_night(state)
    config = tmp_path / "night.toml"
    config.write_text(f'[server]\nmodel_path = "m"\n[state]\ndir = "{state}"\n')
    now = str(1_764_460_800 + 6000)
    env_now = {**os.environ, "TZ": "UTC"}
    code = ("import sys; from supervisor.cli.report import write_report; from supervisor.core.config import load_config; "
            f"print(write_report(load_config(sys.argv[1]), fmt=sys.argv[2], output=sys.argv[3], since_s=12*3600, now={now}))")
    text = subprocess.run([sys.executable, "-c", code, str(config), "text", "-"], capture_output=True, text=True,
                          cwd=REPO, env=env_now, timeout=60)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "cuda_oom_runtime × 1" in out and "0.93 at the start → 0.88 at the end" in out
    assert "Nothing" not in out and "no open problem" in out
    assert "02:45:00  launch #2 at mem_fraction_static=0.88" not in out  # 01:01:42 UTC, not a made-up time
    assert "01:01:42  launch #2 at mem_fraction_static=0.88" in out
    assert "1.0 GB at the least" in out or "0.8 GB at the least" in out
    png = tmp_path / "night.png"
    r = subprocess.run([sys.executable, "-c", code, str(config), "png", str(png)], capture_output=True, text=True,
                       cwd=REPO, env=env_now, timeout=120)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.parametrize(("args", "extra", "journal", "code", "line"), [
    (("--since", "soon"), "", True, 2, "--since 'soon': not a duration"),
    ((), "", False, 1, "no journal in {state}: the daemon writes journal.jsonl there"),
    (("-o", "{tmp}/no/such/dir/r.html"), "", True, 1, "-o {tmp}/no/such/dir/r.html: cannot write: No such file"),
    ((), '[report]\ntimezone = "Mars/Olympus_Mons"\n', True, 2, "timezone = 'Mars/Olympus_Mons': must be an IANA zone"),
    (("--server", "tp9"), "", True, 2, "--server 'tp9': no such server"),
])
def test_report_bad_input_is_one_line(tmp_path, args, extra, journal, code, line):
    """A bad flag, a state directory the daemon never wrote, an output it cannot write, an
    unknown zone: one line on stderr and a non-zero exit, never a traceback or an empty page."""
    state = tmp_path / "state"
    state.mkdir()
    if journal:
        _journal_night(state)
    config = tmp_path / "c.toml"
    config.write_text(f'[server]\nmodel_path = "m"\n[state]\ndir = "{state}"\n{extra}')
    r = run_cli("report", "--config", str(config), *(a.format(tmp=tmp_path) for a in args), "--format", "text")
    assert r.returncode == code and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert line.format(state=state, tmp=tmp_path) in r.stderr


def test_a_section_per_server(tmp_path):
    """Several [[server]] entries: each server's night from STATE_DIR/NAME, a section each."""
    _journal_night(tmp_path / "state" / "tp4-a")
    config = tmp_path / "two.toml"
    config.write_text(
        f'[state]\ndir = "{tmp_path / "state"}"\n'
        '[[server]]\nname = "tp4-a"\nmodel_path = "m"\nport = 30001\n'
        '[[server]]\nname = "tp4-b"\nmodel_path = "m"\nport = 30002\n'
    )
    code = ("import sys; from supervisor.cli.report import write_report; from supervisor.core.config import load_config; "
            "print(write_report(load_config(sys.argv[1]), fmt=sys.argv[2], output=sys.argv[3], since_s=12*3600, "
            "now=1_764_460_800 + 6000))")
    text = subprocess.run([sys.executable, "-c", code, str(config), "text", "-"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert text.returncode == 0, text.stderr
    a, b = text.stdout.split("== server tp4-b ==")
    assert "== server tp4-a ==" in a and "cuda_oom_runtime × 1" in a
    assert "cuda_oom_runtime" not in b and "crashes by cause" in b
    page = tmp_path / "two.html"
    r = subprocess.run([sys.executable, "-c", code, str(config), "html", str(page)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    source = page.read_text()
    assert '<section id="server-tp4-a">' in source and '<section id="server-tp4-b">' in source
    assert source.count("data:image/png;base64,") == 2
    one = run_cli("report", "--config", str(config), "--server", "tp4-a", "--since", "3000d", "--format", "text")
    assert one.returncode == 0 and "cuda_oom_runtime × 1" in one.stdout and "tp4-b" not in one.stdout, one.stderr
    none = run_cli("report", "--config", str(config), "--server", "tp4-b", "--format", "text")
    assert none.returncode == 1 and f"no journal in {tmp_path / 'state' / 'tp4-b'}" in none.stderr


def test_gpus_with_the_same_night_share_one_line():
    """Eight tensor-parallel ranks with the same free memory are one line "GPU 0–7", not seven
    lines hidden under the eighth; a rank that differs keeps its own."""
    from supervisor.report.chart import gpu_series
    from supervisor.sinks.gpuring import Ring

    same = Ring(indices=tuple(range(8)), total_mib=(98304,) * 8, sample_s=60, capacity=10, times=(1.0, 2.0),
                free_mib=((1024,) * 8, (5120,) * 8))
    assert gpu_series(same) == [("GPU 0–7", [1.0, 5.0])]
    apart = Ring(indices=(0, 1, 4), total_mib=(98304,) * 3, sample_s=60, capacity=10, times=(1.0, 2.0),
                 free_mib=((1024, 1024, 2048), (1024, 1024, 4096)))
    assert gpu_series(apart) == [("GPU 0, 1", [1.0, 1.0]), ("GPU 4", [2.0, 4.0])]


def test_an_event_line_says_only_what_the_log_said():
    """A CPU server has no CUDA graphs: its startup facts carry the KV pool and no 'None GB'."""
    from supervisor.report import event_line

    assert event_line({"kind": "startup_facts", "max_total_num_tokens": 4096, "avail_mem_after_capture_gb": None}) == (
        "startup facts: max_total_num_tokens=4096")
    assert event_line({"kind": "startup_facts", "max_total_num_tokens": 258992, "avail_mem_after_capture_gb": 0.82}) == (
        "startup facts: 0.82 GB after CUDA-graph capture, max_total_num_tokens=258992")
    assert event_line({"kind": "startup_facts"}) == "startup facts: none read"
