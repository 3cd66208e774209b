"""The cyclic garbage collector held off while a death is read (issue 36).

A full collection walks the daemon's whole heap with the GIL held: 16-24 ms on the bench's
machine (a ``gc.callbacks`` probe in the crash bench's daemons), about twice in a run of 25
crashes. The crash path allocates more than anything else the daemon does (the tail, its
lines, the diagnosis's matches), so that is where a collection most often fell due: the run's
slowest crash, noticed and diagnosed, was the one a full collection overlapped.

A hold keeps automatic collection off from a death (``Died``) until its diagnosis has been
fed to the core (``Diagnosed``: the ``crash`` event is out, the relaunch asked for), with a
bound in case no diagnosis comes. It delays a collection by tens of milliseconds; it collects
nothing less (cycles made meanwhile are collected by the next one, which the allocations
already counted bring due). Freezing the heap instead (``gc.freeze``) made a full collection
cheap but grew the real soak's RSS past its bound (the README, "Issue 36's goals").

A launch is the daemon's other burst (the spawn, the start-up lines, READY's events and state
file, the last launch's end): a full collection it brought due could fall right after READY,
where a crash that comes early met it (the bench's crash 50 ms after READY did, 22 ms late).
``settle`` collects once per launch instead, right after the spawn, while the server loads
its weights and nothing waits on the daemon: the count starts again from a clean heap, and an
automatic full collection seldom falls due between two launches.

The collector is one per process: the holds of several servers' units are counted, and it
runs again when the last one ends. One that was off before the first hold stays off.
"""

from __future__ import annotations

import asyncio
import gc

HOLD_MAX_S = 10.0  # a death whose diagnosis never comes holds the collector this long at most

_holders = 0
_was_enabled = False


class GcHold:
    """One unit's hold (at most one at a time): ``hold`` at a death, ``release`` once it
    is read; the hold ends by itself after ``max_s``."""

    def __init__(self, max_s: float = HOLD_MAX_S) -> None:
        self._max_s = max_s
        self._timer: asyncio.TimerHandle | None = None

    @property
    def held(self) -> bool:
        return self._timer is not None

    def hold(self) -> None:
        global _holders, _was_enabled
        if self._timer is not None:
            return
        self._timer = asyncio.get_running_loop().call_later(self._max_s, self.release)
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1

    def release(self) -> None:
        global _holders
        if self._timer is None:
            return
        self._timer.cancel()
        self._timer = None
        _holders -= 1
        if _holders == 0 and _was_enabled:
            gc.enable()


def settle() -> None:
    """A full collection now (a server was just spawned: nothing waits on the daemon),
    unless a death is being read (a hold) or the collector is off."""
    if _holders == 0 and gc.isenabled():
        gc.collect()
