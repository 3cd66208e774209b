"""The time rules of the config: ``[policy] climb_window`` ("HH:MM-HH:MM", local time, wrapping
past midnight), ``[report] daily_at`` ("HH:MM") and ``[report] timezone`` (an IANA zone)."""

from __future__ import annotations


def _window(text: str) -> tuple[int, int] | None:
    """``[policy] climb_window`` as (start, end) minutes after local midnight; (0, 0) for ""
    (any time); None when malformed. An end before the start wraps past midnight."""
    if text == "":
        return (0, 0)
    parts = text.split("-")
    if len(parts) != 2:
        return None
    out = []
    for part in parts:
        hh, sep, mm = part.strip().partition(":")
        if not (sep and hh.isdigit() and mm.isdigit() and int(hh) < 24 and int(mm) < 60):
            return None
        out.append(int(hh) * 60 + int(mm))
    return (out[0], out[1]) if out[0] != out[1] else None


def in_window(text: str, minute: int) -> bool:
    """Whether ``minute`` (after local midnight) lies in ``[policy] climb_window``."""
    window = _window(text)
    if window is None or window == (0, 0):
        return window is not None
    start, end = window
    return start <= minute < end if start < end else minute >= start or minute < end


def _time_of_day(v: str) -> bool:
    if v == "":
        return True
    hh, sep, mm = v.partition(":")
    return bool(sep) and hh.isdigit() and mm.isdigit() and len(mm) == 2 and int(hh) < 24 and int(mm) < 60


def _zone_name(v: str) -> bool:
    """"" (the host's zone) or an IANA zone this host's tz database knows."""
    if v == "":
        return True
    from zoneinfo import ZoneInfo

    try:
        ZoneInfo(v)
    except (KeyError, ValueError, OSError):  # ZoneInfoNotFoundError is a KeyError
        return False
    return True
