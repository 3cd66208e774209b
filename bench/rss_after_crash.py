"""The daemon's RSS in a production install, serving and after 10 crashes diagnosed
(issue 26, item 3; issue 36, item 2). A production install has no test extras: make one with

    python3 -m venv /tmp/prodvenv && /tmp/prodvenv/bin/pip install .

then ``.venv/bin/python -m bench.rss_after_crash /tmp/prodvenv``. The daemon supervises the
simulator (the tests' fast config with production-like probe and GPU intervals, metrics
on); 20 s after READY its RSS is read; then the server is SIGKILLed 10 times, each crash
diagnosed and the server serving again, and the RSS is read 20 s after the first and after
the tenth.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from tests.harness import write_config  # noqa: E402

CRASHES = 10  # issue 36: <= 40 MB serving and after 10 crashes


def main(venv: str) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rss-"))
    cfg = write_config(tmp, {
        "health": {"interval_s": 5.0, "timeout_s": 5.0, "failures": 3, "startup_timeout_s": 60.0, "startup_poll_s": 0.5},
        "gpu": {"interval_s": 5.0}, "metrics": {"enabled": True, "listen": "127.0.0.1:0"},
        "policy": {"backoff_initial_s": 0.0, "backoff_jitter": 0.0, "max_crashes": 100000},
    })
    log_path = tmp / "daemon.log"

    def events() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]

    def wait(kind: str, count: int = 1, timeout_s: float = 90.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if sum(e.get("event") == kind for e in events()) >= count:
                return
            time.sleep(0.5)
        raise SystemExit(f"rss_after_crash: no {kind} x{count} within {timeout_s:g} s (see {log_path})")

    with log_path.open("w") as log:
        daemon = subprocess.Popen([f"{venv}/bin/sglang-supervisor", "run", "--config", str(cfg)], stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    proc = psutil.Process(daemon.pid)
    try:
        wait("server_ready")
        time.sleep(20)
        serving = proc.memory_info().rss / 2**20
        after: list[float] = []
        for n in range(1, CRASHES + 1):
            os.kill([e for e in events() if e.get("event") == "launch"][-1]["pid"], signal.SIGKILL)
            wait("server_ready", n + 1)
            if n in (1, CRASHES):
                time.sleep(20)
                after.append(proc.memory_info().rss / 2**20)
        causes = sorted({e["cause"] for e in events() if e.get("event") == "crash"})
        print(f"daemon RSS ({venv}): serving {serving:.1f} MB; serving again after 1 crash diagnosed {after[0]:.1f} MB, "
              f"after {CRASHES} {after[-1]:.1f} MB (causes: {', '.join(causes)}; goal <= 40 MB)")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m bench.rss_after_crash VENV (a production install: pip install .)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
