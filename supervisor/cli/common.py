"""What every command shares: the usage exit code and the one-line failure."""

from __future__ import annotations

import sys

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """One line on stderr (``sglang-supervisor: what, where, why``); returns ``code``."""
    print(f"sglang-supervisor: {message}", file=sys.stderr)
    return code
