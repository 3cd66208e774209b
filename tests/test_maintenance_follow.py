"""``services/maintenance.py``'s follower with fake servers: when a ``stop`` or ``start`` is
done. Two things the end-to-end test (tests/test_maintenance_e2e.py) found:

- the core takes a request in its own time: a held server is STOPPED before its start as
  after a stop again, so nothing is judged until the core made the job;
- a started server serves once it is READY *and* back in the router (as in a rolling
  restart), not at READY.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from supervisor.core.model import State
from supervisor.core.state import Hold
from supervisor.services import maintenance


@dataclass(frozen=True)
class FakeCore:
    state: State
    held: Hold | None = None
    attempt: int = 0
    jobs: int = 0
    pid: int | None = None


class FakeUnit:
    """A server whose core moves when the test says so; ``listed``: the router lists it."""

    def __init__(self, name: str, core: FakeCore) -> None:
        self.name = self.label = name
        self.core: FakeCore | None = core
        self.listed = False
        self.asked: list[str] = []
        self._moved = asyncio.Event()

    def request_hold(self, reason: str) -> None:
        self.asked.append("hold")

    def request_start(self, reason: str) -> None:
        self.asked.append("start")

    async def serving(self) -> bool:
        return self.core is not None and self.core.state is State.READY and self.listed

    async def moved(self) -> None:
        await self._moved.wait()
        self._moved.clear()

    def step(self, **changes: Any) -> None:
        assert self.core is not None
        self.core = replace(self.core, **changes)
        self._moved.set()


HELD = FakeCore(State.STOPPED, held=Hold("disk swap", "2025-01-01T00:00:00Z"), attempt=0, jobs=0)


async def settle(lines: AsyncIterator[dict[str, object]], got: list[dict[str, object]]) -> None:
    async for line in lines:
        got.append(line)


async def turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_start_is_not_judged_before_the_core_took_it() -> None:
    unit = FakeUnit("b", HELD)
    before = maintenance.ask(maintenance.START, [unit], "back")  # type: ignore[list-item]
    assert unit.asked == ["start"]
    got: list[dict[str, object]] = []
    task = asyncio.create_task(settle(maintenance.follow(maintenance.START, [unit], before), got))  # type: ignore[list-item]
    await turns()
    # still STOPPED and held: the request is not taken yet, which is not a failure
    assert not [g for g in got if g.get("done")], got
    unit.listed = True
    unit.step(state=State.PREPARING, held=None, jobs=1)
    await turns()
    unit.step(state=State.STARTING, attempt=1)
    await turns()
    unit.step(state=State.READY)
    await asyncio.wait_for(task, 10)
    assert got[-1]["done"] and got[-1]["ok"], got


async def test_a_start_is_done_once_the_router_lists_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(maintenance, "ASK_ROUTER_S", 0.01)
    unit = FakeUnit("b", HELD)
    before = maintenance.ask(maintenance.START, [unit], "back")  # type: ignore[list-item]
    got: list[dict[str, object]] = []
    task = asyncio.create_task(settle(maintenance.follow(maintenance.START, [unit], before), got))  # type: ignore[list-item]
    unit.step(state=State.READY, held=None, jobs=1, attempt=1)
    await asyncio.sleep(0.1)  # READY, asked again and again, not listed: not done
    assert not task.done() and not [g for g in got if g.get("done")], got
    unit.listed = True
    await asyncio.wait_for(task, 10)  # the next ask sees it listed
    assert got[-1]["done"] and got[-1]["ok"], got


async def test_a_start_is_done_without_the_router_after_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that is away does not hold the command forever: the daemon puts the server
    back when it returns."""
    monkeypatch.setattr(maintenance, "ASK_ROUTER_S", 0.01)
    monkeypatch.setattr(maintenance, "ROUTER_WAIT_S", 0.05)
    unit = FakeUnit("b", HELD)
    before = maintenance.ask(maintenance.START, [unit], "back")  # type: ignore[list-item]
    got: list[dict[str, object]] = []
    task = asyncio.create_task(settle(maintenance.follow(maintenance.START, [unit], before), got))  # type: ignore[list-item]
    unit.step(state=State.READY, held=None, jobs=1, attempt=1)
    await asyncio.wait_for(task, 10)
    assert got[-1]["done"] and got[-1]["ok"], got


async def test_a_start_that_is_stopped_again_ends_not_serving() -> None:
    unit = FakeUnit("b", HELD)
    before = maintenance.ask(maintenance.START, [unit], "back")  # type: ignore[list-item]
    got: list[dict[str, object]] = []
    task = asyncio.create_task(settle(maintenance.follow(maintenance.START, [unit], before), got))  # type: ignore[list-item]
    unit.step(state=State.PREPARING, held=None, jobs=1)
    await turns()
    unit.step(state=State.STOPPED, held=Hold("again", "2025-01-01T00:01:00Z"), jobs=2)
    await asyncio.wait_for(task, 10)
    assert got[-1]["done"] and not got[-1]["ok"], got


async def test_a_stop_of_a_held_server_asks_nothing_and_is_done() -> None:
    unit = FakeUnit("b", HELD)
    before = maintenance.ask(maintenance.STOP, [unit], "again")  # type: ignore[list-item]
    assert unit.asked == []
    got: list[dict[str, object]] = []
    await asyncio.wait_for(settle(maintenance.follow(maintenance.STOP, [unit], before), got), 10)  # type: ignore[list-item]
    assert got[-1]["done"] and got[-1]["ok"], got


async def test_a_stop_is_done_when_held_and_stopped() -> None:
    unit = FakeUnit("b", FakeCore(State.READY, attempt=1, jobs=3))
    before = maintenance.ask(maintenance.STOP, [unit], "disk swap")  # type: ignore[list-item]
    assert unit.asked == ["hold"]
    got: list[dict[str, object]] = []
    task = asyncio.create_task(settle(maintenance.follow(maintenance.STOP, [unit], before), got))  # type: ignore[list-item]
    await turns()
    unit.step(state=State.STOPPING, held=Hold("disk swap", "2025-01-01T00:00:00Z"), jobs=4)
    await turns()
    unit.step(state=State.STOPPED)
    await asyncio.wait_for(task, 10)
    assert got[-1]["done"] and got[-1]["ok"], got
    assert [g["state"] for g in got if "state" in g] == ["STOPPING", "STOPPED"], got
