"""A wall clock that jumps, for the chaos matrix's "wall-clock jump" fault.

Put this directory on ``PYTHONPATH`` and set ``CHAOS_CLOCK_JUMP=1``: every Python process
started that way (the daemon, and the simulator it launches, which inherits PYTHONPATH)
sees ``time.time()``, ``time.time_ns()`` and ``datetime.now()`` jump by hours and days, back
and forth, every 0.7 s. The monotonic clock is left alone: nothing that decides may notice.
Changing the real clock needs privileges (and would disturb the whole machine).
"""

from __future__ import annotations

import os

if os.environ.get("CHAOS_CLOCK_JUMP") == "1":
    import datetime as _datetime
    import time as _time

    _real_time = _time.time
    _real_time_ns = _time.time_ns
    _real_datetime = _datetime.datetime
    _start = _time.monotonic()
    _OFFSETS = (0.0, 86400.0, -3600.0, 600.0, -2 * 86400.0)  # +1 day, -1 h, +10 min, -2 days

    def _offset() -> float:
        return _OFFSETS[int((_time.monotonic() - _start) / 0.7) % len(_OFFSETS)]

    def _time_jumping() -> float:
        return _real_time() + _offset()

    def _time_ns_jumping() -> int:
        return _real_time_ns() + int(_offset() * 1e9)

    class _JumpingDatetime(_real_datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[override]
            return _real_datetime.now(tz) + _datetime.timedelta(seconds=_offset())

        @classmethod
        def utcnow(cls):  # type: ignore[override]
            return cls.now(_datetime.UTC).replace(tzinfo=None)

        @classmethod
        def today(cls):  # type: ignore[override]
            return cls.now()

    _time.time = _time_jumping
    _time.time_ns = _time_ns_jumping
    _datetime.datetime = _JumpingDatetime  # type: ignore[misc]
