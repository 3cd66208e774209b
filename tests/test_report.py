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
from typing import Any

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


def dom_after(browser: str, tmp: Path, page: str, script: str) -> str:
    """The DOM Chromium renders for a copy of ``page`` with ``script`` run at its end (the page
    itself has no script): what a test reads of the rendered page."""
    probe = tmp / "probe.html"
    probe.write_text(page.replace("</body>", f"<script>{script}</script></body>"))
    dumped = headless(browser, tmp, "--dump-dom", probe.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    return dumped.stdout


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
         'SGLANG_PYSPY_DUMP_BEFORE_CRASH="0", SGLANG_CUDA_COREDUMP_BEFORE_CRASH="0"}'],  # as supervisor/sim/demo.toml has
        capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    state_dir = re.search(r"state in (\S+)", demo.stdout).group(1)  # type: ignore[union-attr]
    # `make demo` ends with the night's report and its path
    own = re.search(r"^the night's report: (\S+)$", demo.stdout, re.M)
    assert own and Path(own.group(1)).read_text().startswith("<!DOCTYPE html>"), demo.stdout
    page = tmp_path / "report.html"
    r = run_cli("report", "--config", str(REPO / "supervisor" / "sim" / "demo.toml"), "--set", f"state.dir={state_dir}",
                "--set", f"gpu.sim_dir={tmp_path / 'gpus'}", "--since", "1h", "-o", str(page))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == page.resolve()
    source = page.read_text()
    assert "data:image/png;base64," in source
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", source), "the page must not fetch anything"

    # What Chromium rendered, and where it put the chart: a copy of the page with one script
    # that writes the image's box into the DOM (the page itself has no script).
    dom = dom_after(browser, tmp_path, source, (
        "const r = document.querySelector('img.chart').getBoundingClientRect();"
        "const p = document.createElement('pre'); p.id = 'chart-box';"
        "p.textContent = JSON.stringify({x: r.x, y: r.y, w: r.width, h: r.height,"
        " loaded: document.querySelector('img.chart').naturalWidth});"
        "document.body.appendChild(p);"))
    text = visible_text(dom)
    assert "cuda_oom_runtime" in text
    assert re.search(r"crash: cuda_oom_runtime \(serving\) at 0\.93, next at 0\.88", text), text[:3000]
    assert re.search(r"fraction 0\.93 → 0\.88, relaunched in \d", text), text[:3000]  # the crash table's remedy
    assert "0.93 at the start → 0.88 at the end" in text
    # the memory model's last word, from the demo's own recommended_fraction records
    assert re.search(r"What to change (Recommended mem_fraction_static: (raise it to|keep|lower it to) 0\.\d+"
                     r"|No recommended mem_fraction_static yet: needs )", text), text[:3000]
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


WORDS_091 = ("0.91 (now 0.88) would give +19 % KV tokens (220,922) and leave 2.4 GB at the observed peak on the "
             "tightest rank (TP3); headroom stops it higher")
WORDS_090 = ("0.9 (now 0.88) would give +12 % KV tokens (207,927) and leave 3.1 GB at the observed peak on the "
             "tightest rank (TP3); out-of-memory at 0.91 stops it higher")
WORDS_KEEP = ("0.9 (now 0.9) would give +0 % KV tokens (207,927) and leave 3.1 GB at the observed peak on the "
              "tightest rank (TP3); out-of-memory at 0.91 stops it higher")
CLIMB_NIGHT_END = 19800  # seconds after 2025-11-30 00:00 UTC: 05:30


def _journal_night(state: Path, *, climbs: bool = False) -> None:
    """The demo night written through the real sinks, at fixed wall times; with ``climbs``,
    what the memory model did after it (issue 25): KV pressure at 0.88, 0.91 recommended, a
    climb to 0.91 at 02:30 that dies of a CUDA OOM on probation and falls back to 0.88 at
    03:10, 0.9 recommended, a climb to 0.9 at 04:30 kept after its 30 min probation (05:02)."""
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
    if climbs:
        _climbs(at, changed)
    journal.close()
    ring.close()


def _climbs(at, changed) -> None:
    """The climbs night's events, written in time order (the ring's samples among them)."""
    timeline: list[tuple[float, Any]] = []  # (dt, event or (from, to, fraction) for a state change)

    def recommended(dt: float, fraction: float, now: float, tokens_now: int, tokens_at: int, headroom: float,
                    words: str) -> None:
        timeline.append((dt, ev.Recommended(fraction=fraction, mem_fraction_static=now, kv_tokens_now=tokens_now,
                                            kv_tokens_at=tokens_at, headroom_gb=headroom, rank="TP3", missing="",
                                            words=words, points=2)))

    def climb(dt: float, frm: float, to: float, gain: float, words: str, attempt: int) -> None:
        timeline.append((dt, ev.Climbed(mem_fraction_before=frm, mem_fraction_static=to, kv_tokens_gain=gain,
                                        words=words)))
        timeline.append((dt, (State.READY, State.RESTARTING, frm)))
        relaunch(dt + 5, State.RESTARTING, Cause.CLIMB, frm, to, attempt)

    def relaunch(dt: float, frm_state: State, cause: Cause, frm: float, to: float, attempt: int) -> None:
        timeline.append((dt, (frm_state, State.BACKOFF, to)))
        timeline.append((dt, ev.RestartScheduled(delay_s=0.0, cause=cause, mem_fraction_static=to, hicache_size_gb=None,
                                                 attempt=attempt, rung=None, mem_fraction_before=frm)))
        timeline.append((dt + 1, (State.BACKOFF, State.STARTING, to)))
        timeline.append((dt + 1, ev.ServerLaunched(argv=("python",), mem_fraction_static=to, hicache_size_gb=None,
                                                   attempt=attempt, pid=attempt, rung=None, launch_id=f"l{attempt}")))
        timeline.append((dt + 115, (State.STARTING, State.READY, to)))

    timeline.append((7200, ev.KvPressureSeen(source="retraction", detail="#retracted_reqs: 3", signals=3,
                                             mem_fraction_static=0.88)))
    recommended(7800, 0.91, 0.88, 185649, 220922, 2.4, WORDS_091)
    timeline.append((8400, ev.KvPressureSeen(source="metrics", detail="token_usage 0.99, #queue-req 12", signals=2,
                                             mem_fraction_static=0.88)))
    climb(9000, 0.88, 0.91, 0.19, WORDS_091, 3)  # 02:30, READY at 02:32
    timeline.append((11400, (State.READY, State.EXITED, 0.91)))
    timeline.append((11400, ev.Crash(
        cause=Cause.CUDA_OOM_RUNTIME, remedy=Remedy.FRACTION_DOWN, phase=Phase.SERVING, exit_code=None, signal=9,
        evidence=("torch.OutOfMemoryError: CUDA out of memory.",), evidence_lineno=1, location=None, rank="TP3",
        exc_type=None, exc_message=None, mem_fraction_static=0.91, hicache_size_gb=None, attempt=3,
        next_mem_fraction_static=0.88, next_hicache_size_gb=None, next_retry_s=0.0, consecutive_failures=1)))
    timeline.append((11400, ev.ClimbFellBack(mem_fraction_failed=0.91, mem_fraction_static=0.88,
                                            cause=Cause.CUDA_OOM_RUNTIME)))
    relaunch(11400, State.EXITED, Cause.CUDA_OOM_RUNTIME, 0.91, 0.88, 4)  # 03:10, READY at 03:11
    recommended(11516, 0.9, 0.88, 185649, 207927, 3.1, WORDS_090)
    timeline.append((14400, ev.KvPressureSeen(source="retraction", detail="#retracted_reqs: 1", signals=1,
                                             mem_fraction_static=0.88)))
    climb(16200, 0.88, 0.9, 0.12, WORDS_090, 5)  # 04:30, READY at 04:32
    recommended(16321, 0.9, 0.9, 207927, 207927, 3.1, WORDS_KEEP)
    timeline.append((18121, ev.ClimbKept(mem_fraction_static=0.9, probation_s=1800.0)))  # 05:02
    samples = [(5640.0 + 60 * k, None) for k in range(int((CLIMB_NIGHT_END - 5640) // 60))]
    for dt, item in sorted([*timeline, *samples], key=lambda pair: pair[0]):  # stable: same-time order kept
        if item is None:
            at(dt, ev.GpuSample(gpus=()), 3.4 if 9000 <= dt < 11400 else 4.4)
        elif isinstance(item, tuple):
            changed(dt, *item)
        else:
            at(dt, item)


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
    assert "What to change" not in out and "KV pressure" not in out  # the memory model said nothing that night
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


# --- the memory model's word (issue 25): the recommended fraction, KV pressure, climbs -------


def _climbs_config(tmp_path: Path, *, climbs: bool = True):
    from supervisor.core.config import load_config

    state = tmp_path / ("climbs" if climbs else "plain")
    _journal_night(state, climbs=climbs)
    config = tmp_path / f"{state.name}.toml"
    config.write_text(f'[server]\nmodel_path = "m"\n[state]\ndir = "{state}"\n[report]\ntimezone = "UTC"\n')
    return load_config(str(config))


def _text_report(tmp_path: Path, cfg, end: float) -> str:
    from supervisor.cli.report import write_report

    path = write_report(cfg, fmt="text", output=str(tmp_path / "night.txt"), since_s=12 * 3600,
                        now=1_764_460_800 + end)
    assert path is not None
    return path.read_text()


def _what_to_change(out: str) -> list[str]:
    """The "What to change" section, one entry a line (wrapped sentences joined)."""
    assert out.index("What to do now:") < out.index("What to change:") < out.index("state now")
    section = out.split("What to change:\n", 1)[1].split("\n\n", 1)[0]
    entries: list[str] = []
    for line in section.splitlines():
        if line.startswith("  - ") or line.startswith("      "):
            entries.append(line.strip().removeprefix("- "))
        else:
            entries[-1] += " " + line.strip()
    return entries


KV_WORDS = ("Not a crash: SGLang's KV cache ran short while serving (requests retracted or queued), the sign that a "
            "higher fraction would pay.")


def test_what_to_change_says_the_recommended_fraction_kv_pressure_and_each_climb(tmp_path):
    """The climbs night in words, where a reader looks for what to change: the last
    recommendation (0.9 kept: it runs 0.9 now), six KV pressure signals by source with the
    last one, each climb, the fall-back and the climb kept, with their local times."""
    out = _text_report(tmp_path, _climbs_config(tmp_path), CLIMB_NIGHT_END)
    assert _what_to_change(out) == [
        "Recommended mem_fraction_static: keep 0.9: it leaves 3.1 GB at the observed peak on the tightest rank "
        "(TP3); out-of-memory at 0.91 stops it higher (the memory model, 04:32).",
        f"KV pressure: 6 signals (4 retraction, 2 metrics), the last at 04:00 at 0.88 (retraction: #retracted_reqs: 1)."
        f" {KV_WORDS}",
        "climbs:",
        "raised to 0.91 at 02:30 (from 0.88): +19 % KV tokens",
        "fell back to 0.88 at 03:10: 0.91 failed on probation (a CUDA OOM while serving)",
        "raised to 0.9 at 04:30 (from 0.88): +12 % KV tokens",
        "kept 0.9 at 05:02, after its 30 min probation",
    ]
    assert "cuda_oom_runtime × 2" in out and "0.93 at the start → 0.9 at the end" in out
    assert "02:30:00  climb: 0.88 → 0.91: +19 % KV tokens" in out  # and in the night's events
    assert "03:10:00  climb fell back to 0.88: 0.91 failed on probation (cuda_oom_runtime)" in out


def test_what_to_change_before_the_second_climb(tmp_path):
    """At 03:20, after the fall-back: raise it to 0.9 (the model's arithmetic), the pressure
    so far, one climb and its fall-back."""
    out = _text_report(tmp_path, _climbs_config(tmp_path), 12000)
    assert _what_to_change(out) == [
        f"Recommended mem_fraction_static: raise it to 0.9. {WORDS_090} (the memory model, 03:11).",
        "KV pressure: 5 signals (3 retraction, 2 metrics), the last at 02:20 at 0.88 (metrics: token_usage 0.99, "
        f"#queue-req 12). {KV_WORDS}",
        "climbs:",
        "raised to 0.91 at 02:30 (from 0.88): +19 % KV tokens",
        "fell back to 0.88 at 03:10: 0.91 failed on probation (a CUDA OOM while serving)",
    ]


def test_the_recommendation_in_words_when_it_has_none_is_stale_or_from_before_the_night():
    """None yet: what the model is missing. Said before a later launch at another fraction:
    it says so. Said before the night: with its date."""
    from zoneinfo import ZoneInfo

    from supervisor.core.night import summarize
    from supervisor.report import fraction_lines

    utc = ZoneInfo("UTC")
    t0 = 1_764_460_800.0  # 2025-11-30 00:00 UTC
    missing = "needs the least free GPU memory seen while serving (no load seen yet)"
    records = [
        {"t": t0 - 7200, "kind": "launch", "mem_fraction_static": 0.88, "attempt": 1},
        {"t": t0 - 3600, "kind": "recommended_fraction", "fraction": None, "mem_fraction_static": 0.88,
         "missing": missing, "words": f"no recommended fraction yet: {missing}"},
    ]
    said, climbed = fraction_lines(summarize(records, start=t0, end=t0 + 3600, floor=0.8), utc)
    assert said == [f"No recommended mem_fraction_static yet: {missing} (the memory model, 2025-11-29 23:00)."]
    assert climbed == []
    later = [*records,
             {"t": t0 + 60, "kind": "recommended_fraction", "fraction": 0.91, "mem_fraction_static": 0.88,
              "kv_tokens_now": 100_000, "kv_tokens_at": 119_000, "headroom_gb": 2.4, "rank": "TP3", "words": ""},
             {"t": t0 + 120, "kind": "launch", "mem_fraction_static": 0.85, "attempt": 2}]
    said, _ = fraction_lines(summarize(later, start=t0, end=t0 + 3600, floor=0.8), utc)
    assert said == ["Recommended mem_fraction_static: raise it to 0.91. 0.91 would give +19 % KV tokens and leave "
                    "2.4 GB at the observed peak on the tightest rank (TP3) (the memory model, 00:01). It was said at "
                    "0.88; the server runs 0.85 now."]
    assert fraction_lines(summarize(records[:1], start=t0, end=t0 + 3600, floor=0.8), utc) == ([], [])


def _pixels(png: bytes, rgb: tuple[int, int, int]) -> int:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 22) or []
    return sum(n for n, colour in colours if colour == rgb)


def test_the_chart_marks_climbs_and_fall_backs(tmp_path):
    """The climbs night's chart has the climb's green up-arrows and the fall-back's orange
    down-arrow (their colours, which nothing else on the chart uses); the demo night's has neither."""
    from zoneinfo import ZoneInfo

    from supervisor.report import chart, collect

    utc = ZoneInfo("UTC")
    green, orange = (0x1A, 0x98, 0x50), (0xE6, 0x61, 0x01)
    assert chart.CLIMB == "#1a9850" and chart.FELL_BACK == "#e66101"
    climbs = collect(_climbs_config(tmp_path), since_s=12 * 3600, now=1_764_460_800 + CLIMB_NIGHT_END, tz=utc)
    drawn = chart.png(climbs, utc, ["climbs"])
    assert _pixels(drawn, green) > 200 and _pixels(drawn, orange) > 100
    plain = collect(_climbs_config(tmp_path, climbs=False), since_s=12 * 3600, now=1_764_460_800 + 6000, tz=utc)
    assert plain[0].night.crash_markers and not plain[0].night.climbs
    drawn = chart.png(plain, utc, ["plain"])
    assert _pixels(drawn, green) == 0 and _pixels(drawn, orange) == 0


@pytest.mark.integration
def test_the_climbs_nights_page_in_a_real_browser(tmp_path):
    """The climbs night's HTML report in headless Chromium: "What to change" is rendered before
    the chart, with the recommendation, the KV pressure line and each climb; the night's events
    list the climb and the fall-back."""
    from supervisor.cli.report import write_report

    browser = chromium()
    page = write_report(_climbs_config(tmp_path), fmt="html", output=str(tmp_path / "climbs.html"),
                        since_s=12 * 3600, now=1_764_460_800 + CLIMB_NIGHT_END)
    assert page is not None
    dumped = headless(browser, tmp_path, "--dump-dom", page.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    text = visible_text(dumped.stdout)
    change = text.index("What to change")
    assert text.index("What to do now") < change < text.index("Summary")
    said = text[change:text.index("Summary")]
    assert said.startswith("What to change Recommended mem_fraction_static: keep 0.9: it leaves 3.1 GB"), said
    assert "KV pressure: 6 signals (4 retraction, 2 metrics), the last at 04:00 at 0.88" in said
    assert "Not a crash" in said and "a higher fraction would pay" in said
    assert ("Climbs: raised to 0.91 at 02:30 (from 0.88): +19 % KV tokens fell back to 0.88 at 03:10: 0.91 failed on "
            "probation (a CUDA OOM while serving) raised to 0.9 at 04:30 (from 0.88): +12 % KV tokens kept 0.9 at "
            "05:02, after its 30 min probation") in said
    assert "climb: 0.88 → 0.91: +19 % KV tokens" in text and "climb kept: 0.9 served through its 30 min probation" in text
    assert '<ul class="fraction">' in page.read_text() and page.read_text().count("data:image/png;base64,") == 1
