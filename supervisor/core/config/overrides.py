"""``--set SECTION.KEY=VALUE``: one override, its value read as TOML (a bare word as a string)."""

from __future__ import annotations

import tomllib
from typing import Any

from supervisor.core.config.rules import ConfigError


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value). The value is read as TOML; a bare
    word that is not valid TOML is taken as a string (``state.dir=/tmp/x``)."""
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {text[:80]!r}: expected SECTION.KEY=VALUE (e.g. server.port=30001)")
    if "\n" in raw or "\r" in raw:
        raise ConfigError(f"--set {path.strip()[:80]}: the value must be on one line")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        # Not TOML (or TOML Python refuses: a 5,000-digit integer, deep nesting): a string.
        value = raw
    return section, key, value
