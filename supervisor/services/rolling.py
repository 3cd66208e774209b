"""The rolling restart: ``sglang-supervisor restart`` over one server or several, one at a time.

Each server is taken out of the router, drained, stopped, relaunched, READY and back in the
router before the next one starts. In a pass over several, a server is taken down only while
another one serves: the pass waits for one that is on its way up, and ends, leaving the rest
alone, when none is. A server that does not come back (it gave up, or the daemon is
stopping) ends the pass there.

The pass awaits the units' state changes (``ServerUnit.moved``); only the router's listing,
which nothing pushes, is asked again, twice a second, and for ``ROUTER_WAIT_S`` at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from supervisor.aio import first_of
from supervisor.core import events as ev
from supervisor.core.model import State
from supervisor.core.state import Core

ROUTER_WAIT_S = 30.0  # how long a READY server may take to be listed healthy by the router
ASK_ROUTER_S = 0.5  # how often the router is asked meanwhile
GONE = (State.GAVE_UP, State.STOPPED, State.STOPPING)


class Unit(Protocol):
    """What the pass needs of a server (``unit.ServerUnit``)."""

    name: str
    label: str

    @property
    def core(self) -> Core | None: ...
    def request_restart(self, reason: str) -> None: ...
    async def serving(self) -> bool: ...
    async def moved(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PassEnd:
    """How a pass ended: ``ok`` when every server in it is READY again at a later launch."""

    ok: bool
    detail: str


async def any_moved(units: Sequence[Unit], timeout_s: float | None = None) -> None:
    """Until one of ``units`` takes a step (or ``timeout_s`` passes)."""
    await first_of({f"{u.name}:moved": u.moved() for u in units}, timeout_s)


async def roll(units: Sequence[Unit], everyone: Sequence[Unit], reason: str,
               emit: Callable[[ev.Event], None]) -> PassEnd:
    """Restart ``units`` (of ``everyone``, the daemon's servers) one at a time."""
    for i, unit in enumerate(units):
        if len(units) > 1 and not await _another_serves(unit, [u for u in everyone if u is not unit], emit):
            return PassEnd(False, f"no other server serves or is starting: {unit.name} was not taken down")
        emit(ev.RollingRestart(step="restart", server=unit.label, detail=f"{i + 1} of {len(units)}: {reason}"))
        end = await _restart_one(unit, reason, emit)
        if end is not None:
            return end
    detail = f"{len(units)} server(s) restarted one at a time"
    emit(ev.RollingRestart(step="done", detail=detail))
    return PassEnd(True, detail)


async def _restart_one(unit: Unit, reason: str, emit: Callable[[ev.Event], None]) -> PassEnd | None:
    """Restart ``unit`` and wait until it serves again (None), or says why it will not."""
    before = unit.core.attempt if unit.core else 0
    unit.request_restart(reason)
    loop = asyncio.get_running_loop()
    left = False
    ready_at: float | None = None
    while True:
        core = unit.core
        if core is not None:
            left = left or core.state is not State.READY
            if left and core.state in GONE:
                detail = f"{unit.name} is {core.state}: the servers after it are left as they are"
                emit(ev.RollingRestart(step="stopped", server=unit.label, detail=detail))
                return PassEnd(False, detail)
            if core.state is State.READY and core.attempt > before:
                ready_at = ready_at or loop.time()
                if await unit.serving():
                    return None
                if loop.time() - ready_at > ROUTER_WAIT_S:
                    # The router is away: the server is READY, the router's view is reconciled
                    # when it returns; the pass goes on.
                    emit(ev.RollingRestart(step="unregistered", server=unit.label, detail=(
                        f"{unit.name} is READY but not in the router after {ROUTER_WAIT_S:g} s: going on")))
                    return None
                await any_moved([unit], ASK_ROUTER_S)
                continue
        await unit.moved()


async def _another_serves(unit: Unit, others: Sequence[Unit], emit: Callable[[ev.Event], None]) -> bool:
    """Wait until a server other than ``unit`` takes traffic; False when none is READY or
    on its way there (all gave up or stopped)."""
    def waiting(coming: Sequence[Unit]) -> None:
        emit(ev.RollingRestart(step="waiting", server=unit.label,
                               detail=f"waiting for {', '.join(u.name for u in coming)} to serve first"))

    if await another_serves(others, waiting):
        return True
    emit(ev.RollingRestart(step="stopped", server=unit.label, detail=(
        f"no other server serves or is starting: {unit.name} is not taken down "
        f"(restart --server {unit.name} does it alone)")))
    return False


async def another_serves(others: Sequence[Unit], waiting: Callable[[Sequence[Unit]], None] | None = None) -> bool:
    """Until one of ``others`` takes traffic (True), or none is READY or on its way there
    (False: all gave up or stopped). ``waiting`` hears, once, whom it waits for."""
    said = False
    while not [u for u in others if await u.serving()]:
        coming = [u for u in others if u.core is not None and u.core.state not in (State.GAVE_UP, State.STOPPED)]
        if not coming:
            return False
        if not said and waiting is not None:
            waiting(coming)
        said = True
        # a state change, or the router's listing (asked again twice a second)
        await any_moved(coming, ASK_ROUTER_S)
    return True
