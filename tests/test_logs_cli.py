"""``sglang-supervisor logs`` (issue 33): the last lines, one launch (counted as ``explain``
counts them), and ``-f`` following the file through a relaunch and the daemon's rotation."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
from pathlib import Path

import tomli_w
from harness import REPO

from supervisor.adapters.output import RotatingLog
from supervisor.cli.logs import logs
from supervisor.core.config import load_config
from supervisor.core.diagnosis.launches import launch_marker


def setup(tmp_path: Path) -> tuple[Path, Path]:
    state = tmp_path / "state"
    state.mkdir()
    path = tmp_path / "sup.toml"
    path.write_text(tomli_w.dumps({"state": {"dir": str(state)}, "server": {"model_path": "/m"}}))
    return path, state / "server.log"


def launch(n: int, *lines: str) -> str:
    return launch_marker(n, f"2026-12-03T0{n}:00:00Z", ["python", "-m", "sglang.launch_server"]) + "\n" + \
        "".join(f"{line}\n" for line in lines)


def test_the_last_lines_and_one_launch(tmp_path: Path) -> None:
    path, log = setup(tmp_path)
    log.write_text(launch(1, "a1", "a2", "The server is fired up and ready to roll!", "boom") + launch(2, "b1")
                   + launch(1, "c1", "c2"))  # a daemon restart counts from 1 again: still the 3rd launch
    cfg = load_config(str(path), [])
    out = io.StringIO()
    assert logs(cfg, server=None, lines=2, launch=None, follow=False, out=out) == 0
    assert out.getvalue() == "c1\nc2\n"
    out = io.StringIO()
    assert logs(cfg, server=None, lines=0, launch=1, follow=False, out=out) == 0
    assert out.getvalue().splitlines()[1:] == ["a1", "a2", "The server is fired up and ready to roll!", "boom"]
    out = io.StringIO()
    assert logs(cfg, server=None, lines=0, launch=3, follow=False, out=out) == 0
    assert out.getvalue().splitlines()[1:] == ["c1", "c2"]


def test_no_such_launch_and_no_log_are_one_line(tmp_path: Path) -> None:
    path, log = setup(tmp_path)
    cmd = [sys.executable, "-m", "supervisor.cli", "logs", "--config", str(path)]
    none = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert none.returncode == 1 and none.stderr.count("\n") == 1 and "no server log yet" in none.stderr
    log.write_text(launch(1, "x"))
    bad = subprocess.run([*cmd, "--launch", "4"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "the log holds 1" in bad.stderr


def test_follow_goes_on_through_a_relaunch_and_the_rotation(tmp_path: Path) -> None:
    """The daemon's own RotatingLog writes; ``-f`` prints every line once, in order,
    including those written to the old file just before it was renamed."""
    path, log_path = setup(tmp_path)
    writer = RotatingLog(log_path, 4096, 2)
    writer.write(launch(1, "old").encode())
    written: list[str] = []

    def write() -> None:
        time.sleep(0.3)
        for i in range(200):  # ~10 KB: rotates at least twice
            if i == 100:
                line = launch(2).rstrip("\n")
            else:
                line = f"line {i} " + "x" * 40
            writer.write(f"{line}\n".encode())
            written.append(line)
            time.sleep(0.01)  # a file lasts ~0.8 s: longer than the follower's poll
        writer.close()

    t = threading.Thread(target=write)
    t.start()
    out = io.StringIO()
    cfg = load_config(str(path), [])
    assert logs(cfg, server=None, lines=1, launch=None, follow=True, out=out, until=time.monotonic() + 5.0) == 0
    t.join()
    assert Path(f"{log_path}.1").exists()  # it did rotate
    assert out.getvalue().splitlines() == ["old", *written]
