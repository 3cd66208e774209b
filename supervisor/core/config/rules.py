"""The one-line error and the value rules a field's ``rule`` metadata names.

``ConfigError`` is every refusal; ``_rule`` builds a field's metadata (the words shown and
the check run on the converted value); the checks below are those the sections share.
``_show`` and ``_did_you_mean`` shape a user's value and a near-miss name for the message.
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from typing import Any


class ConfigError(ValueError):
    """A config that cannot be used; ``str()`` is the one line shown to the user.

    Keys and values come from the user's file, so control characters are escaped here:
    whatever the input, the message stays one printable line.
    """

    def __init__(self, message: str) -> None:
        line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        super().__init__(line if len(line) <= 400 else line[:397] + "...")


def _rule(text: str, check: Any = None) -> dict[str, Any]:
    return {"rule": text, "check": check}


def _port(v: int) -> bool:
    return 0 <= v <= 65535


def _positive(v: float) -> bool:
    return v > 0 and math.isfinite(v)


def _non_negative(v: float) -> bool:
    return v >= 0 and math.isfinite(v)


def _url(v: str) -> bool:
    return v == "" or (v.startswith(("http://", "https://")) and len(v) > len("https://") and not any(c.isspace() for c in v))


def _fraction(v: float) -> bool:
    return 0.0 < v < 1.0


def _share(v: float) -> bool:
    return 0.0 <= v <= 1.0


def _listen(v: str) -> bool:
    host, sep, port = v.rpartition(":")
    return bool(sep and host and port.isdigit() and _port(int(port)))


def _unit_name(v: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", v))


def _endpoints(v: tuple[str, ...]) -> bool:
    return all(bool(e) and not any(c.isspace() for c in e) for e in v)


def _hostport(v: str) -> bool:
    host, sep, port = v.rpartition(":")
    return bool(sep and host and port.isdigit() and 1 <= int(port) <= 65535)


def _etcd_prefix(v: str) -> bool:
    return v.startswith("/") and len(v.rstrip("/")) > 0 and not any(c.isspace() for c in v)


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # a huge integer, a deeply nested array
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _did_you_mean(word: str, choices: typing.Iterable[str], form: str) -> str:
    """``"; did you mean 'mem_fraction_static'?"`` for the closest known name, else ``""``."""
    close = difflib.get_close_matches(word[:200], list(choices), n=1)
    return f"; did you mean {form.format(close[0])}?" if close else ""
