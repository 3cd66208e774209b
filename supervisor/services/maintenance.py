"""An operator's ``stop`` and ``start`` of a server while the daemon stays up (maintenance).

``sglang-supervisor stop --server NAME`` asks the daemon for a hold: the core's ``hold`` job
takes the server out of the router, drains it (as a planned restart does), stops it and
keeps it stopped, across daemon restarts too (the state file keeps the hold), until
``start``, whose ``start`` job prepares and launches it again. No crash is counted, no
step-down. With one server the daemon stays up and idle, so a GPU can be serviced without
touching systemd.

This module says what is asked of which server, refuses what cannot be done (one line,
said back on the control socket), and follows the servers until the request is done: each
state they pass, then one last line (``done``), the way ``restart`` follows a rolling pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol, TypeVar

from supervisor.aio import first_of
from supervisor.core.model import State
from supervisor.core.state import Core

STOP, START = "stop", "start"
WAIT_STEP_S = 5.0  # how often a follower looks again when nothing moved (a daemon that stops)
# A started server counts once the router lists it healthy, as in a rolling restart
# (services/rolling.py): asked this often, for this long at most (a router away).
ROUTER_WAIT_S = 30.0
ASK_ROUTER_S = 0.5


class Unit(Protocol):
    """What a stop or a start needs of a server (``unit.ServerUnit``)."""

    name: str
    label: str

    @property
    def core(self) -> Core | None: ...
    def request_hold(self, reason: str) -> None: ...
    def request_start(self, reason: str) -> None: ...
    async def serving(self) -> bool: ...
    async def moved(self) -> None: ...


U = TypeVar("U", bound=Unit)


def refusal(cmd: str, units: Sequence[Unit]) -> str | None:
    """Why ``cmd`` cannot be done to ``units`` now (None: it can)."""
    for unit in units:
        core = unit.core
        if core is None:
            return f"{unit.name} is not started yet"
        if cmd == STOP and core.state is State.STOPPING:
            return f"{unit.name} is already stopping"
        if cmd == START and core.held is None and core.state is not State.GAVE_UP:
            return f"{unit.name} is {core.state}, not stopped by an operator: nothing to start (restart relaunches it)"
        if cmd == START and core.state is State.GAVE_UP and core.pid is not None:
            return f"{unit.name} gave up and its server is still being stopped: try again in a moment"
    return None


def startable(units: Sequence[U]) -> list[U]:
    """The servers a ``start`` can launch: held by an operator, or given up."""
    return [u for u in units if u.core is not None and (u.core.held is not None or u.core.state is State.GAVE_UP)]


def ask(cmd: str, units: Sequence[Unit], reason: str) -> list[dict[str, object]]:
    """Ask each unit; what each was before (its name, state and launch, and ``jobs``: the
    core's job count when it was asked, None when nothing was asked of it)."""
    before: list[dict[str, object]] = []
    for unit in units:
        line = _line(unit)
        asked = cmd == START or (unit.core is not None and unit.core.held is None)
        line["jobs"] = unit.core.jobs if asked and unit.core is not None else None
        before.append(line)
        if not asked:
            continue
        if cmd == STOP:
            unit.request_hold(reason)
        else:
            unit.request_start(reason)
    return before


def done(cmd: str, unit: Unit, attempt_before: int, jobs_before: int | None = None) -> bool | None:
    """Whether ``cmd`` is done for ``unit``: True (stopped and held; or READY at a later
    launch), False (it will not be: it gave up, or the daemon is stopping it for good),
    None (not yet). ``jobs_before``: the core's job count when it was asked; until the core
    has made the job (it takes the request in its own time) nothing is judged: a held server
    is STOPPED before its start as after a stop again."""
    core = unit.core
    if core is None or (jobs_before is not None and core.jobs <= jobs_before):
        return None
    if cmd == STOP:
        if core.state is State.STOPPED:
            return core.held is not None
        return None
    if core.state is State.READY and core.attempt > attempt_before:
        return True
    if core.state in (State.GAVE_UP, State.STOPPED, State.STOPPING) and core.attempt > attempt_before:
        return False  # launched, and did not come up
    if core.held is not None and core.state is State.STOPPED:
        return False  # held again before it launched (the core took the start: ``jobs_before``)
    return None


async def follow(cmd: str, units: Sequence[Unit], before: Sequence[dict[str, object]]) -> AsyncIterator[dict[str, object]]:
    """Each state the units pass until ``cmd`` is done for every one, then the last line."""
    attempts = {str(b["name"]): int(b["attempt"] or 0) for b in before}  # type: ignore[call-overload]
    jobs = {str(b["name"]): b.get("jobs") for b in before}
    seen = {u.name: (u.core.state if u.core else None) for u in units}
    outcome: dict[str, bool] = {}
    ready_at: dict[str, float] = {}  # a started server READY, not yet listed by the router
    while True:
        for unit in units:
            state = unit.core.state if unit.core else None
            if state != seen[unit.name]:
                seen[unit.name] = state
                yield {"server": unit.label, "state": str(state)}
            if unit.name not in outcome:
                asked = jobs.get(unit.name)
                ended = done(cmd, unit, attempts.get(unit.name, 0), asked if isinstance(asked, int) else None)
                if ended and cmd == START and not await _in_router(unit, ready_at):
                    ended = None  # READY, and back in the router before it is said to serve
                if ended is not None:
                    outcome[unit.name] = ended
        if len(outcome) == len(units):
            failed = [name for name, ok in outcome.items() if not ok]
            detail = (f"{len(units)} server(s) {'stopped and held' if cmd == STOP else 'serving again'}" if not failed
                      else f"{', '.join(failed)}: not {'held' if cmd == STOP else 'serving'} "
                           f"({', '.join(str(seen[n]) for n in failed)})")
            yield {"done": True, "ok": not failed, "detail": detail, "servers": [_line(u) for u in units]}
            return
        left = [u for u in units if u.name not in outcome]
        await first_of({u.name: u.moved() for u in left},
                       ASK_ROUTER_S if any(u.name in ready_at for u in left) else WAIT_STEP_S)


async def _in_router(unit: Unit, ready_at: dict[str, float]) -> bool:
    """A READY server takes traffic (``serving``: listed healthy by the router, when there is
    one), or the router did not list it within ``ROUTER_WAIT_S``: it is away, the daemon puts
    the server back when it returns, and the start is done."""
    if await unit.serving():
        return True
    now = asyncio.get_running_loop().time()
    return now - ready_at.setdefault(unit.name, now) > ROUTER_WAIT_S


def _line(unit: Unit) -> dict[str, object]:
    core = unit.core
    return {"name": unit.name, "state": str(core.state) if core else None, "attempt": core.attempt if core else None,
            "held": core.held.reason if core and core.held else None}
