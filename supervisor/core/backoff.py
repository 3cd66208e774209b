"""The one backoff of the code base: restarts (``policy``) and every reconnect loop (MQTT,
router, group, fleet) wait by it."""

from __future__ import annotations

import math


def exponential_backoff(
    n: int, *, initial: float, factor: float, maximum: float, jitter: tuple[float, float], sample: float
) -> float:
    """The one backoff of the code base: ``min(maximum, initial * factor**n)`` times a jitter.

    ``n`` counts from 0 (the first wait is ``initial``); ``jitter`` is the window ``(low,
    high)`` of the multiplier and ``sample`` a uniform draw from [0, 1) supplied by the caller
    (an injected ``random.Random``), which picks ``low + (high - low) * sample`` in it, so the
    function stays pure. Safe for any ``n`` and any finite ``factor``: the exponent is clamped
    and an overflow becomes the cap. Never negative.
    """
    exponent = min(max(n, 0), 64)  # beyond 2**64 steps every sane schedule is at its cap
    try:
        base = initial * factor**exponent
    except OverflowError:
        base = math.inf
    base = min(base, maximum)
    low, high = jitter
    return max(0.0, base * (low + (high - low) * sample))
