"""Fuzzed server output through the daemon's own path: a diagnosis, never an exception.

The pure readers have their own fuzz tests (tests/test_diagnosis_fuzz.py); this covers what
the daemon does around them: a real process writes random bytes and giant lines into the
pipe, ``ServerProcess`` pumps them into the rotating log, the in-memory tail and the
startup-facts parser (line by line, as the daemon does while starting), and the tail is
diagnosed the way ``Daemon._watch`` does it. Diagnosis must not fail internally either (it
would hide the failure in an ``InternalError`` diagnosis). Last, the real daemon supervises
a "server" that spews 20 MB without a newline and dies: a crash event, no task failure.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import psutil
from conftest import wait_until
from harness import DaemonRun, write_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.adapters.output import RotatingLog
from supervisor.adapters.process import ServerProcess
from supervisor.core.diagnosis import INTERNAL_ERROR_TYPE, diagnose
from supervisor.core.diagnosis.startup_facts import StartupFactsParser
from supervisor.core.model import Diagnosis, Phase

SGLANG_LINES = [
    b"[2026-11-29 07:22:21 TP0] Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, avail mem=23.67 GB, mem usage=72.33 GB.\n",
    b"[2026-11-29 07:22:25 TP0] KV Cache is allocated. #tokens: 412345, K size: 9.1 GB, V size: 9.1 GB\n",
    b"[2026-11-29 07:22:40 TP0] Capture cuda graph end. Time elapsed: 12.1 s. mem usage=5.9 GB. avail mem=0.82 GB.\n",
    b"[2026-11-29 07:22:41 TP0] Scheduler hit an exception: Traceback (most recent call last):\n",
    b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 96.00 GiB\n",
    b"RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: 0.76\n",
    b"The server is fired up and ready to roll!\n",
]
chunks = st.one_of(
    st.binary(max_size=4096),
    st.sampled_from(SGLANG_LINES),
    st.builds(lambda b, n: b * n, st.sampled_from([b"x", b"\xff", b"\0", b"\r", b"\n", b"GB. avail mem="]),
              st.integers(1, 200_000)),
)
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


async def pump_and_diagnose(path: Path, tmp: Path, phase: Phase | None, kernel: str | None) -> Diagnosis:
    """``cat path`` as the server, through the daemon's output path, then its diagnosis."""
    log = RotatingLog(tmp / "server.log", 64 * 1024, 2)
    server = await ServerProcess.spawn(["cat", str(path)], env={"PATH": os.environ.get("PATH", "")},
                                       cwd=str(tmp), log=log, tail_bytes=64 * 1024)
    parser = StartupFactsParser()
    server.on_line = parser.feed
    status = await server.wait()
    server.kill_leftovers()
    await server.drain_output(5.0)
    diagnosis = diagnose(server.tail.get(), exit_status=status, phase=phase, kernel_log=kernel, pids=server.tree_pids())
    await server.close()
    return diagnosis


def _no_children() -> None:
    wait_until(lambda: not [p for p in psutil.Process().children(recursive=True) if p.is_running()],
               timeout=10, what="no child process left")


@FUZZ
@given(parts=st.lists(chunks, max_size=12), phase=st.sampled_from([*Phase, None]),
       kernel=st.one_of(st.none(), st.text(max_size=500)))
def test_random_output_through_the_pipe_gives_a_diagnosis(tmp_path: Path, parts: list[bytes], phase: Phase | None,
                                                          kernel: str | None) -> None:
    """Random bytes, NULs, CR floods and giant lines from a real process: a real diagnosis."""
    out = tmp_path / "output.bin"
    out.write_bytes(b"".join(parts))
    diagnosis = asyncio.run(pump_and_diagnose(out, tmp_path, phase, kernel))
    assert isinstance(diagnosis, Diagnosis)
    assert diagnosis.exc_type != INTERNAL_ERROR_TYPE, diagnosis.exc_message
    assert all(len(e) <= 10_000 for e in diagnosis.evidence)
    _no_children()


SPEW = (
    "import os, sys\n"
    "out = sys.stdout.buffer\n"
    "out.write(b'Scheduler hit an exception: ' + b'A' * (20 * 1024 * 1024))\n"
    "out.write(os.urandom(1024 * 1024))\n"
    "out.write(b'\\ntorch.OutOfMemoryError: CUDA out of memory. ' + b'\\xff' * 100000 + b'\\n')\n"
    "out.flush()\n"
    "sys.exit(1)\n"
)


def test_daemon_diagnoses_a_server_that_spews_giant_lines(tmp_path: Path) -> None:
    """20 MB without a newline plus random bytes, then death: the daemon reports a crash and
    decides (here: give up, the crash budget is 1); no task fails, nothing is left."""
    cfg = write_config(
        tmp_path,
        {"server": {"command": [sys.executable, "-c", SPEW]}, "policy": {"max_crashes": 1},
         "gpu": {"backend": "none"}},
    )
    with DaemonRun(cfg) as d:
        crash = d.wait_for("crash", timeout=60)
        assert crash["cause"] and crash["exc_type"] != INTERNAL_ERROR_TYPE
        assert d.wait_for("gave_up")
        assert d.stop() == 0
    text = d.log_path.read_text(errors="replace")
    assert "task_failed" not in text and "Traceback" not in text
    _no_children()
