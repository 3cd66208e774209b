"""The daemon's RSS in a production install, serving and after crashes (issue 26, item 3;
issue 36, item 2: <= 40 MB serving and after 10 crashes).

A production install is ``pip install sglang-supervisor`` with no extra: no simulator
extras, no test tools (structlog brings rich where the test extras have it). ``production_venv``
makes one from this tree in ``bench/.venv-prod`` (git-ignored), again only when the tree's
sources changed. The daemon, run from it, supervises the simulator (run by the project's own
venv) with production-like probe and GPU intervals and metrics served; ``SETTLE_S`` after
READY its RSS is read; then the server's main process is SIGKILLed ``CRASHES`` times, each
crash diagnosed (the catalogue read from the install) and the server serving again, and the
RSS is read ``SETTLE_S`` after the last. ``python -m bench.rss_after_crash VENV`` measures
another install the same way.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from . import common
from .common import BENCH, REPO, BenchError, Daemon, Row, Section, Settings, Stat

VENV = BENCH / ".venv-prod"
CRASHES = 10  # issue 36: <= 40 MB serving and after 10 crashes
SETTLE_S = 20.0
GOAL_MB = 40.0


def _sources_digest() -> str:
    """What a production install is made of: the package's files and pyproject.toml."""
    h = hashlib.sha256()
    files = sorted(p for p in (REPO / "supervisor").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in [REPO / "pyproject.toml", *files]:
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def production_venv(venv: Path = VENV) -> Path:
    """A virtualenv with this tree installed as a user installs it (``pip install .``, no extra)."""
    digest, stamp = _sources_digest(), venv / ".sources"
    if stamp.exists() and stamp.read_text() == digest and (venv / "bin" / "sglang-supervisor").exists():
        return venv
    for step in (
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(REPO)],
    ):
        r = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise BenchError(f"production install: {' '.join(step[:4])} ... failed: {(r.stderr or r.stdout)[-500:]}")
    stamp.write_text(digest)
    return venv


def measure(settings: Settings, work: Path, venv: Path, crashes: int, settle_s: float) -> tuple[float, float, list[str]]:
    """(RSS serving, RSS serving again after ``crashes`` crashes) in MB, and the causes read."""
    sim = common.simulator("--sim-load-s", "0.2", "--sim-drain-poll-s", "0.25")
    sections = common.daemon_sections(settings, work, sim, {
        "server": {"tp_size": 2, "stop_grace_s": 3.0},
        "health": {"interval_s": 5.0, "timeout_s": 5.0, "failures": 3, "startup_timeout_s": 60.0, "startup_poll_s": 0.5},
        "gpu": {"interval_s": 5.0, "release_timeout_s": 5.0},
        "metrics": {"enabled": True, "listen": f"127.0.0.1:{common.free_port()}"},
    })
    daemon = Daemon(settings, work, sections, python=str(venv / "bin" / "python"))
    proc = psutil.Process(daemon.pid)
    try:
        daemon.wait_for(common.event_is("server_ready"), 120, "the server ready")
        time.sleep(settle_s)  # the daemon settling at its serving size: a window, not a wait for readiness
        serving = proc.memory_info().rss / 2**20
        for n in range(1, crashes + 1):
            pid = [e for e in daemon.events() if e.get("event") == "launch"][-1]["pid"]
            os.kill(pid, signal.SIGKILL)
            daemon.wait_for(common.event_is("server_ready", attempt=n + 1), 120, f"the server ready after crash {n}")
        time.sleep(settle_s)
        after = proc.memory_info().rss / 2**20
        causes = sorted({e["cause"] for e in daemon.events() if e.get("event") == "crash"})
        return serving, after, causes
    finally:
        daemon.stop()
        common.reap_tagged(settings.tag)


def run(settings: Settings) -> Section:
    crashes, settle = (2, 3.0) if settings.quick else (CRASHES, SETTLE_S)
    venv = production_venv()
    got: list[tuple[float, float]] = []
    causes: set[str] = set()
    for r in range(settings.repeats):
        serving, after, why = measure(settings, settings.dir(f"rss-{r}"), venv, crashes, settle)
        got.append((serving, after))
        causes.update(why)
    serving_s, after_s = Stat.of([s for s, _ in got]), Stat.of([a for _, a in got])
    scene = (f"`pip install .` with no extra ({venv.relative_to(REPO)}); metrics served, a probe every 5 s, "
             f"8 simulated GPUs read every 5 s, tp 2; read {settle:g} s after READY")
    section = Section("rss", raw={"crashes": crashes, "settle_s": settle, "serving_after_mb": got,
                                  "causes": sorted(causes)})
    section.rows += [
        Row("rss_serving", "RSS, production install, serving", "MB", serving_s, None, f"≤ {GOAL_MB:g} MB",
            serving_s.value <= GOAL_MB, note=scene),
        Row("rss_after_crashes", f"RSS, production install, serving again after {crashes} crashes diagnosed", "MB",
            after_s, None, f"≤ {GOAL_MB:g} MB", after_s.value <= GOAL_MB,
            note=f"the server's main process SIGKILLed {crashes} times; causes read: {', '.join(sorted(causes))}"),
    ]
    return section
