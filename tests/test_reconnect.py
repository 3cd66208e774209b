"""supervisor.aio.Reconnect: the one reconnect loop of the group, the router, the fleet and MQTT.

Deterministic: the clock is a number the test moves, ``sleep`` records the waits instead of
waiting, and the jitter window is (1, 1) unless a test is about the jitter, so every wait is
exact. Nothing here is timed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from supervisor.aio import Backoff, Reconnect

BACKOFF = Backoff(initial=1.0, maximum=8.0, factor=2.0, jitter=(1.0, 1.0))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Stop(Exception):
    """Raised by the fake sleep to end a run after so many waits."""


class Link:
    """A Reconnect over a fake clock and a recording sleep, with its reports collected."""

    def __init__(self, *, good_after_s: float = 0.0, waits: int = 100, backoff: Backoff = BACKOFF) -> None:
        self.clock = Clock()
        self.delays: list[float] = []
        self.reports: list[tuple[str, object]] = []
        self._waits = waits

        async def sleep(delay: float) -> None:
            self.delays.append(delay)
            self.clock.now += delay
            if len(self.delays) >= self._waits:
                raise Stop

        self.r = Reconnect(
            "test", backoff, on_down=lambda e: self.reports.append(("down", str(e))),
            on_up=lambda down_s: self.reports.append(("up", down_s)), good_after_s=good_after_s,
            rng=random.Random(0), clock=self.clock, sleep=sleep,
        )

    async def run(self, sessions: list[Callable[[], object]]) -> None:
        """Run the loop over ``sessions``, one per try; each may call connected, move the
        clock, and raise (a failure) or return (the end)."""
        queue = list(sessions)

        async def session() -> None:
            queue.pop(0)()

        with pytest.raises(Stop):
            await self.r.run(session)


def fail(message: str = "refused") -> Callable[[], None]:
    def step() -> None:
        raise OSError(message)
    return step


async def test_the_backoff_grows_and_is_capped() -> None:
    """Failures in a row wait initial * 2**n up to the cap: 1, 2, 4, 8, 8, 8."""
    link = Link(waits=6)
    await link.run([fail()] * 6)
    assert link.delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_each_wait_is_jittered_in_the_window() -> None:
    """The jitter multiplies the wait by a draw in the window (here [d/2, d]), as the
    project's one backoff does; a sample of 0 gives the window's low end."""
    backoff = Backoff(initial=1.0, maximum=8.0, jitter=(0.5, 1.0))
    assert backoff.delay(2, 0.0) == 2.0
    assert backoff.delay(2, 0.5) == 3.0
    assert backoff.delay(10, 0.0) == 4.0  # the cap, jittered
    draws = [Reconnect("x", backoff, rng=random.Random(seed)).failed(OSError()) for seed in range(20)]
    assert all(0.5 <= d <= 1.0 for d in draws) and len(set(draws)) > 1


async def test_one_down_report_per_outage_and_one_up_report_with_its_duration() -> None:
    """Five failures are one outage (one down report); connecting ends it with its length;
    the next break is a second outage."""
    link = Link(waits=7)

    def up_then_break() -> None:
        link.r.connected()
        link.clock.now += 50
        raise OSError("connection lost")

    await link.run([fail("refused 1"), fail("refused 2"), fail("refused 3"), fail("refused 4"), fail("refused 5"),
                    up_then_break, fail("refused again")])
    # down at 100; the waits 1+2+4+8+8 = 23 s later it connects
    assert link.reports == [("down", "refused 1"), ("up", 23.0), ("down", "connection lost")]
    assert link.r.outages == 2


async def test_the_attempt_count_starts_again_after_a_good_session() -> None:
    """After a session that connected, the next outage backs off from the start."""
    link = Link(waits=6)

    def up_then_break() -> None:
        link.r.connected()
        raise OSError("connection lost")

    await link.run([fail(), fail(), fail(), up_then_break, fail(), fail()])
    assert link.delays == [1.0, 2.0, 4.0, 1.0, 2.0, 4.0]


async def test_a_session_that_drops_at_once_is_not_good_and_keeps_backing_off() -> None:
    """With good_after_s, a session must last that long to reset the count: one dropped
    after 1 s keeps the outage's backoff growing; one that lasted 60 s resets it."""
    link = Link(good_after_s=30.0, waits=6)

    def up_for(seconds: float) -> Callable[[], None]:
        def step() -> None:
            link.r.connected()
            link.clock.now += seconds
            raise OSError("dropped")
        return step

    await link.run([fail(), fail(), up_for(1.0), up_for(1.0), up_for(60.0), fail()])
    assert link.delays == [1.0, 2.0, 4.0, 8.0, 1.0, 2.0]
    assert [kind for kind, _ in link.reports] == ["down", "up", "down", "up", "down", "up", "down"]


async def test_the_first_connection_reports_up_without_an_outage() -> None:
    """No failure before: on_up(None); a session that returns ends the loop (a close)."""
    link = Link()
    ended = False

    async def session() -> None:
        nonlocal ended
        link.r.connected()
        ended = True

    await link.r.run(session)
    assert ended and link.reports == [("up", None)] and link.delays == []


def test_calls_report_through_connected_and_failed() -> None:
    """A caller of single calls (the router's reconcile) reports each outcome: one down,
    the growing waits, one up; answers while up report nothing more."""
    link = Link()
    r = link.r
    r.connected()
    r.connected()
    waits = [r.failed(OSError("503")) for _ in range(3)]
    link.clock.now += 10
    r.connected()
    r.connected()
    assert waits == [1.0, 2.0, 4.0]
    assert link.reports == [("up", None), ("down", "503"), ("up", 10.0)]
    assert r.failed(OSError("again")) == 1.0


async def test_a_cancellation_propagates_from_a_session_and_from_the_wait() -> None:
    """Cancelling the loop while a session runs, or while it waits out the backoff, ends it
    cancelled: never caught, never retried."""
    started = asyncio.Event()

    async def hangs() -> None:
        started.set()
        await asyncio.Event().wait()

    r = Reconnect("x", BACKOFF)
    task = asyncio.create_task(r.run(hangs))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and r.outages == 0

    waiting = asyncio.Event()

    async def sleep(_delay: float) -> None:
        waiting.set()
        await asyncio.Event().wait()

    async def fails() -> None:
        raise OSError("refused")

    r = Reconnect("x", BACKOFF, sleep=sleep)
    task = asyncio.create_task(r.run(fails))
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and r.outages == 1


async def test_a_session_that_raises_cancelled_error_is_not_retried() -> None:
    """A CancelledError out of a session is not a failure: it ends the loop."""
    calls = 0

    async def session() -> None:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError

    r = Reconnect("x", BACKOFF)
    with pytest.raises(asyncio.CancelledError):
        await r.run(session)
    assert calls == 1 and r.outages == 0


async def test_only_retry_on_errors_are_retried() -> None:
    """An error outside retry_on is not an outage: it ends the loop, raised."""
    r = Reconnect("x", BACKOFF, retry_on=OSError)

    async def session() -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        await r.run(session)
    assert r.outages == 0
