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

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from supervisor.aio import first_of
from supervisor.core.model import State
from supervisor.core.state import Core

STOP, START = "stop", "start"
WAIT_STEP_S = 5.0  # how often a follower looks again when nothing moved (a daemon that stops)


class Unit(Protocol):
    """What a stop or a start needs of a server (``unit.ServerUnit``)."""

    name: str
    label: str

    @property
    def core(self) -> Core | None: ...
    def request_hold(self, reason: str) -> None: ...
    def request_start(self, reason: str) -> None: ...
    async def moved(self) -> None: ...


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


def startable(units: Sequence[Unit]) -> list[Unit]:
    """The servers a ``start`` can launch: held by an operator, or given up."""
    return [u for u in units if u.core is not None and (u.core.held is not None or u.core.state is State.GAVE_UP)]


def ask(cmd: str, units: Sequence[Unit], reason: str) -> list[dict[str, object]]:
    """Ask each unit; what each was before (its name, state and launch)."""
    before: list[dict[str, object]] = [_line(u) for u in units]
    for unit in units:
        if cmd == STOP:
            if unit.core is not None and unit.core.held is None:
                unit.request_hold(reason)
        else:
            unit.request_start(reason)
    return before


def done(cmd: str, unit: Unit, attempt_before: int) -> bool | None:
    """Whether ``cmd`` is done for ``unit``: True (stopped and held; or READY at a later
    launch), False (it will not be: it gave up, or the daemon is stopping it for good),
    None (not yet)."""
    core = unit.core
    if core is None:
        return None
    if cmd == STOP:
        if core.state is State.STOPPED:
            return core.held is not None
        return None
    if core.state is State.READY and core.attempt > attempt_before:
        return True
    if core.state in (State.GAVE_UP, State.STOPPED, State.STOPPING) and core.attempt > attempt_before:
        return False  # launched, and did not come up (or stopped again meanwhile)
    return None


async def follow(cmd: str, units: Sequence[Unit], before: Sequence[dict[str, object]]) -> AsyncIterator[dict[str, object]]:
    """Each state the units pass until ``cmd`` is done for every one, then the last line."""
    attempts = {str(b["name"]): int(b["attempt"] or 0) for b in before}  # type: ignore[call-overload]
    seen = {u.name: (u.core.state if u.core else None) for u in units}
    outcome: dict[str, bool] = {}
    while True:
        for unit in units:
            state = unit.core.state if unit.core else None
            if state != seen[unit.name]:
                seen[unit.name] = state
                yield {"server": unit.label, "state": str(state)}
            if unit.name not in outcome:
                ended = done(cmd, unit, attempts.get(unit.name, 0))
                if ended is not None:
                    outcome[unit.name] = ended
        if len(outcome) == len(units):
            failed = [name for name, ok in outcome.items() if not ok]
            detail = (f"{len(units)} server(s) {'stopped and held' if cmd == STOP else 'serving again'}" if not failed
                      else f"{', '.join(failed)}: not {'held' if cmd == STOP else 'serving'} "
                           f"({', '.join(str(seen[n]) for n in failed)})")
            yield {"done": True, "ok": not failed, "detail": detail, "servers": [_line(u) for u in units]}
            return
        await first_of({u.name: u.moved() for u in units if u.name not in outcome}, WAIT_STEP_S)


def _line(unit: Unit) -> dict[str, object]:
    core = unit.core
    return {"name": unit.name, "state": str(core.state) if core else None, "attempt": core.attempt if core else None,
            "held": core.held.reason if core and core.held else None}
