"""supervisord 4.3, the reference, in its own virtualenv, supervising the same child.

supervisord's package is also imported as ``supervisor``, so it never shares an
environment with ours: ``ensure_venv`` makes ``bench/.venv-supervisord`` (git-ignored)
with ``pip install supervisor==4.3.0`` the first time. Its config mirrors ours:
autorestart, ``startsecs=0``, stop/kill as a group, stdout (stderr merged) captured to a
size-rotated file as ours is, a unix socket in the run's directory, ``nodaemon``,
``loglevel=info``. Its log lines carry wall-clock times with milliseconds
(``2026-11-29 07:22:21,123 INFO exited: sim (terminated by SIGKILL; not expected)``),
turned into monotonic seconds with an offset measured in the same run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .common import BENCH, BenchError, mono_minus_wall, stop_process

VENV = BENCH / ".venv-supervisord"
VERSION = "4.3.0"
PROGRAM = "sim"
LOG_BYTES = 256 * 1024 * 1024  # the same rotation size as our server log's default
LOG_BACKUPS = 5
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (\w+) (.*)$")


class SupervisordUnavailable(BenchError):
    """supervisord could not be installed or run."""


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment without ``PYTHONPATH``/``PYTHONHOME``: one pointing at this repo
    would make supervisord import our ``supervisor`` package instead of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(extra or {})
    return env


def binary(venv: Path = VENV) -> Path:
    return venv / "bin" / "supervisord"


def ensure_venv(venv: Path = VENV) -> Path:
    """The supervisord executable, installing it into its own virtualenv if needed."""
    exe = binary(venv)
    if exe.exists() and _version(exe) == VERSION:
        return exe
    steps = (
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"supervisor=={VERSION}"],
    )
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, env=clean_env())
        if done.returncode != 0:
            raise SupervisordUnavailable(
                f"cannot install supervisord {VERSION} into {venv}: {' '.join(argv[:4])} exited "
                f"{done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}"
            )
    if _version(exe) != VERSION:
        raise SupervisordUnavailable(f"{exe} does not report version {VERSION}")
    return exe


def _version(exe: Path) -> str | None:
    try:
        done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, check=False,
                              env=clean_env())
    except OSError:
        return None
    return done.stdout.strip() or None


@dataclass(frozen=True, slots=True)
class LogLine:
    mono: float  # monotonic seconds (midpoint of the logged millisecond)
    level: str
    text: str


class Supervisord:
    """One ``supervisord -n`` supervising ``argv`` as program ``sim``."""

    def __init__(self, exe: Path, work: Path, argv: Sequence[str], env: Mapping[str, str], *, autorestart: bool = True) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.log_path = work / "supervisord.log"
        self.child_log = work / "child.log"
        self.config = work / "supervisord.conf"
        self.config.write_text(self._conf(argv, env, autorestart))
        self._offset = mono_minus_wall()
        self.started_ns = time.monotonic_ns()
        self._out = open(work / "supervisord.out", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(exe), "-n", "-c", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT,
            cwd=work, env=clean_env(env),
        )
        self.pid = self.proc.pid

    def _conf(self, argv: Sequence[str], env: Mapping[str, str], autorestart: bool) -> str:
        w = self.work
        environment = ",".join(f'{k}="{v}"' for k, v in env.items())
        return "\n".join([
            "[supervisord]",
            "nodaemon=true",
            f"logfile={self.log_path}",
            "loglevel=info",
            f"pidfile={w / 'supervisord.pid'}",
            f"directory={w}",
            f"childlogdir={w}",
            "[unix_http_server]",
            f"file={w / 'supervisor.sock'}",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
            "[supervisorctl]",
            f"serverurl=unix://{w / 'supervisor.sock'}",
            f"[program:{PROGRAM}]",
            f"command={shlex.join(argv)}",
            f"directory={w}",
            "autostart=true",
            f"autorestart={'true' if autorestart else 'false'}",
            "startsecs=0",
            "startretries=100000",
            "stopasgroup=true",
            "killasgroup=true",
            "stopwaitsecs=5",
            "redirect_stderr=true",
            f"stdout_logfile={self.child_log}",
            f"stdout_logfile_maxbytes={LOG_BYTES}",
            f"stdout_logfile_backups={LOG_BACKUPS}",
            f"environment={environment}",
            "",
        ])

    def lines(self) -> list[LogLine]:
        """supervisord's own log, times converted to monotonic seconds."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        out = []
        for raw in text.splitlines():
            m = _LINE.match(raw)
            if m is None:
                continue
            wall = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000 + 0.0005
            out.append(LogLine(wall + self._offset, m.group(3), m.group(4)))
        return out

    def monos(self, prefix: str) -> list[float]:
        """Times of the lines about our program starting with ``prefix`` (``exited:``, ``spawned:``)."""
        return [ln.mono for ln in self.lines() if ln.text.startswith(f"{prefix} {PROGRAM}")
                or ln.text.startswith(f"{prefix} '{PROGRAM}'")]

    def child_output(self) -> str:
        try:
            return self.child_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        try:
            return stop_process(self.proc)
        finally:
            self._out.close()
