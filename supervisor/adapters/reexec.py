"""Re-executing the daemon in place (``sglang-supervisor reexec``, SIGUSR2; docs/upgrade.md).

- ``check_new_code``: before anything is touched, the installed entry point runs in a child,
  ``--version`` and ``check-config`` on the daemon's own config: new code that cannot even
  start is refused, and the old daemon supervises on.
- ``write``/``read``: the hand-over file in the state directory (atomic, mode 0600): what
  the next daemon needs to adopt each server where it stands. Read only by a daemon whose
  pid is the one that wrote it (``HANDOVER_VAR`` names the file): a stale file from an
  earlier night is never mistaken for a hand-over.
- ``exec_in_place``: the kept file descriptors (each server's output pipe, the SGLang
  parts' pidfds, the state directories' locks) made inheritable, then ``execve`` of the
  same interpreter with the same argv: the same pid, so the servers stay its children.
- ``close_inherited``: a daemon that cannot read its hand-over closes what it inherited
  (a server's pipe left open and unread would stall it once full).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HANDOVER_FILE = "handover.json"
HANDOVER_VAR = "SGLANG_SUPERVISOR_HANDOVER"  # the hand-over's path, set for the exec only
CHECK_TIMEOUT_S = 60.0


def entry_prefix(orig_argv: Sequence[str] | None = None, argv: Sequence[str] | None = None) -> list[str]:
    """How this daemon was started, without its arguments: ``[python, <script>]``, ``[python,
    -m, supervisor.cli]`` ... (``sys.orig_argv`` minus ``sys.argv[1:]``)."""
    orig = list(sys.orig_argv if orig_argv is None else orig_argv)
    args = list(sys.argv if argv is None else argv)
    return orig[: len(orig) - len(args) + 1]


async def check_new_code(prefix: Sequence[str], config_path: str | None, overrides: Sequence[str],
                         env: Mapping[str, str], timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """None when the installed entry point answers ``--version`` and passes ``check-config``
    on the daemon's config; else why not, in one line."""
    checks = [[*prefix, "--version"]]
    if config_path is not None:
        checks.append([*prefix, "check-config", "--config", config_path,
                       *(a for o in overrides for a in ("--set", o))])
    for argv in checks:
        what = " ".join(argv[len(prefix):])
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=dict(env),
            )
        except OSError as exc:
            return f"the new code cannot start ({argv[0]}: {exc.strerror or exc})"
        try:
            async with asyncio.timeout(timeout_s):
                out, _ = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return f"the new code's '{what}' did not answer within {timeout_s:g} s"
        if proc.returncode != 0:
            last = (out.decode("utf-8", "replace").strip().splitlines() or [""])[-1][:300]
            return f"the new code's '{what}' failed (exit {proc.returncode}): {last}"
    return None


def path_in(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / HANDOVER_FILE


def write(path: Path, doc: Mapping[str, Any]) -> None:
    """The hand-over, atomically (temp file, fsync, rename), readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".handover-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        Path(tmp).replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            Path(tmp).unlink()
        raise


def read(path: Path) -> dict[str, Any]:
    """The hand-over's JSON object (raises OSError or ValueError); the file is removed once
    read: a hand-over is used once."""
    try:
        data = json.loads(path.read_bytes())
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")  # noqa: TRY004 - a file's content: json's own ValueError family
    return data


def exec_in_place(keep_fds: Sequence[int], handover: Path, environ: Mapping[str, str] | None = None) -> None:
    """Replace this process's program with the daemon's own command line (same pid), keeping
    ``keep_fds`` open. Returns only if the exec failed (raises OSError)."""
    for fd in keep_fds:
        os.set_inheritable(fd, True)
    env = dict(os.environ if environ is None else environ)
    env[HANDOVER_VAR] = str(handover)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        os.execve(sys.executable, list(sys.orig_argv), env)
    except OSError:
        for fd in keep_fds:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)
        raise


def inherited_path() -> Path | None:
    """The hand-over this process was exec'd with, or None for a daemon started afresh; the
    variable is removed, so nothing launched from here on sees it."""
    value = os.environ.pop(HANDOVER_VAR, None)
    return Path(value) if value else None


def close_inherited(keep_fds: Sequence[int] = ()) -> list[int]:
    """Close every inheritable descriptor above stderr but ``keep_fds`` (what an exec left
    that this daemon does not adopt); returns those closed."""
    closed = []
    for entry in list(Path("/proc/self/fd").iterdir()):
        fd = int(entry.name)
        if fd <= 2 or fd in keep_fds:
            continue
        try:
            if os.get_inheritable(fd):
                os.close(fd)
                closed.append(fd)
        except OSError:
            continue
    return closed
