"""The SGLang version a server will run, for the fleet-memory key (issue 16).

It is read from the package metadata of the server's own Python, in a child process:
the daemon runs from its own virtualenv (which has no SGLang) and must never import sglang
(seconds of torch import, gigabytes of RSS). The child only reads ``importlib.metadata``.
Blocking and bounded: the daemon calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

PROBE = "import importlib.metadata as m; print(m.version('sglang'))"
DETAIL_CHARS = 200


class VersionError(Exception):
    """The version could not be read; ``str()`` is one line naming the Python and why."""


def sglang_version(python: str, timeout_s: float = 30.0, env: Mapping[str, str] | None = None) -> str:
    """The ``sglang`` distribution's version as installed for ``python`` (an executable)."""
    try:
        r = subprocess.run([python, "-c", PROBE], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout_s, env=None if env is None else dict(env), check=False)
    except subprocess.TimeoutExpired:
        raise VersionError(f"reading the sglang version with {python}: no answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise VersionError(f"reading the sglang version with {python}: {exc.strerror or exc}") from None
    version = r.stdout.strip()
    if r.returncode == 0 and version and "\n" not in version:
        return version
    last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    if "PackageNotFoundError" in last:
        raise VersionError(f"sglang is not installed for {python}")
    raise VersionError(f"reading the sglang version with {python} failed: {last[:DETAIL_CHARS]}")


def server_python(command: Sequence[str]) -> str:
    """The Python that runs ``[server] command``: its first word when that is a Python
    (``python3 -m sglang.launch_server``), else the interpreter on its ``#!`` line (a console
    script such as ``/venv/bin/sglang``)."""
    if not command:
        raise VersionError("the server command is empty")
    first = command[0]
    if Path(first).name.startswith("python"):
        return first
    path = first if os.sep in first else shutil.which(first)
    if path is None:
        raise VersionError(f"{first} is not on PATH")
    try:
        with Path(path).open("rb") as f:
            line = f.readline(512)
    except OSError as exc:
        raise VersionError(f"cannot read {first} to find its Python: {exc.strerror or exc}") from None
    words = line[2:].decode(errors="replace").split() if line.startswith(b"#!") else []
    if not words:
        raise VersionError(f"{first} is neither a Python nor a script with a #! line")
    if Path(words[0]).name == "env" and len(words) > 1:  # #!/usr/bin/env python3
        return words[1]
    return words[0]
