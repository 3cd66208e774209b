"""A closed pipe ends a command quietly (issue 22): ``sglang-supervisor explain - | head -3``.

Each command that prints runs with its stdout a pipe whose reader is already gone. It must
end as a command killed by SIGPIPE does in the shell (status 141), and say nothing on
stderr: no BrokenPipeError traceback, no "Exception ignored" from the interpreter's flush.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, DaemonRun, write_config

from supervisor.cli import EXIT_CLOSED_PIPE
from supervisor.core import events as ev
from supervisor.core.model import State
from supervisor.sinks.journal import JournalSink

CRASH_LOG = next(iter(sorted((REPO.parent / "shared" / "crashlogs").glob("*.log"))), None)
EMBEDDED_LOG = (
    "[2025-11-30 02:11:04 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    "of 79.11 GiB of which 839.72 MiB is free.\n"
) * 200


def into_closed_pipe(*args: str, stdin: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``sglang-supervisor ARGS`` with stdout a pipe nobody reads any more."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], stdout=write, stderr=subprocess.PIPE,
                              input=stdin, text=True, cwd=cwd, timeout=120)
    finally:
        os.close(write)


def assert_quiet(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == EXIT_CLOSED_PIPE == 141, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A config with a journal in its state directory (for the report) and MQTT off."""
    path = write_config(tmp_path)
    journal = JournalSink(tmp_path / "state")
    journal.emit(ev.StateChanged(from_=State.STOPPED, to=State.STARTING, reason="boot", mem_fraction_static=0.93,
                                 hicache_size_gb=None, restarts=0, last_cause=None))
    journal.close()
    return path


@pytest.mark.parametrize("argv", [
    ("--help",), ("--version",), ("explain", "--help"),
    ("check-config", "--config", "{config}"),
    ("run", "--config", "{config}", "--dry-run"),
    ("status", "--config", "{config}"), ("status", "--config", "{config}", "--json"),
    ("explain", "{log}"), ("explain", "{log}", "--json"), ("explain", "-"),
    ("preflight", "--config", "{config}"), ("preflight", "--config", "{config}", "--json"),
    ("drill", "--config", "{config}"),
    ("report", "--config", "{config}", "--format", "text"),
    ("demo",),
], ids=lambda a: " ".join(a))
def test_a_printing_command_into_a_closed_pipe_ends_quietly(argv: tuple[str, ...], config: Path, tmp_path: Path,
                                                           no_leftovers: str) -> None:
    log = tmp_path / "crash.log"
    log.write_text(CRASH_LOG.read_text(errors="replace") if CRASH_LOG else EMBEDDED_LOG)
    args = [a.format(config=config, log=log) for a in argv]
    assert_quiet(into_closed_pipe(*args, stdin=EMBEDDED_LOG if args[-1] == "-" else None))


def test_restart_into_a_closed_pipe_ends_quietly(tmp_path: Path, no_leftovers: str) -> None:
    """``restart`` prints as the running daemon goes: the request is accepted, the print fails,
    the command ends quietly; the daemon carries on with the restart."""
    cfg = write_config(tmp_path)
    with DaemonRun(cfg) as d:
        d.wait_for("server_ready")
        assert_quiet(into_closed_pipe("restart", "--config", str(cfg)))
        d.wait_for("server_ready", count=2, timeout=60)
        assert d.stop() == 0
