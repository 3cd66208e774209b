"""The package passes ruff (pyflakes, bugbear, import order, no shell=True)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_package_is_lint_clean() -> None:
    """`ruff check supervisor` reports nothing: unused names, shadowed bugs and shell=True fail CI."""
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "supervisor"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr
