"""The daemon's line before each launch in a server's log (``server.log``), written by the
daemon and read back by ``logs --launch`` and ``explain``: one format, in one place."""

from __future__ import annotations

import re
from collections.abc import Sequence

# "=== sglang-supervisor launch 3 at 2026-12-03T10:00:00Z: python -m sglang.launch_server ..."
LAUNCH_MARKER = re.compile(r"^=== sglang-supervisor launch (?P<n>\d{1,9}) at (?P<at>\S{1,64}): ?(?P<argv>.*)$")


def launch_marker(attempt: int, wall_time: str, argv: Sequence[str]) -> str:
    """The marker line of launch ``attempt`` (with its newline)."""
    return f"=== sglang-supervisor launch {attempt} at {wall_time}: {' '.join(argv)}\n"
