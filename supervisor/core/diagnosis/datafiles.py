"""The diagnosis's generated tables (``data/``: the catalogue and its index, the module table,
the meanings, the start-up functions), read as the plain files they are beside this module in
a checkout and in the wheel. ``importlib.resources`` would bring importlib's readers and
``zipfile`` into the daemon for them (0.3 MB of RSS, issue 36)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"


def read_text(name: str) -> str:
    """A table's text; "" when it is missing or unreadable (the diagnosis then works without it)."""
    try:
        return (DATA_DIR / name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
