"""A real SGLang server on the CPU: starts, answers /generate, drains and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from tests.conftest import free_port_for_later
from tests.real.sglang_env import RealSGLang

READY_DEADLINE_S = 120
EXIT_DEADLINE_S = 30


def _group(pgid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def _tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_real_server_generates_and_drains_on_sigterm(real_sglang: RealSGLang, real_lock, tmp_path: Path):
    port = free_port_for_later()  # bound only after the model load
    log = tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            real_sglang.launch_args(port),
            env=real_sglang.environ(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pgid = proc.pid
    try:
        # Ready: /health answers 200.
        deadline = time.monotonic() + READY_DEADLINE_S
        started = time.monotonic()
        while True:
            assert proc.poll() is None, f"server exited {proc.returncode} before ready:\n{_tail(log)}"
            try:
                if _get(base + "/health", timeout=2) == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, f"not ready after {READY_DEADLINE_S} s:\n{_tail(log)}"
            time.sleep(0.5)
        ready_s = time.monotonic() - started

        # One generation.
        body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 8}}).encode()
        req = urllib.request.Request(base + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            answer = json.loads(r.read())
        assert isinstance(answer.get("text"), str), answer

        # SIGTERM to the main process: exit 0, and nothing of its group left behind.
        os.kill(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=EXIT_DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {EXIT_DEADLINE_S} s after SIGTERM:\n{_tail(log)}") from None
        assert rc == 0, f"exit {rc} after SIGTERM:\n{_tail(log)}"
        left_deadline = time.monotonic() + 10
        while _group(pgid) and time.monotonic() < left_deadline:
            time.sleep(0.2)
        left = [(p.pid, " ".join(p.cmdline())[:80]) for p in _group(pgid)]
        assert not left, f"left behind after exit: {left}"
        print(f"ready in {ready_s:.1f} s; generated {answer['text']!r}")
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
