"""The collector held off from a death until its diagnosis is fed (``supervisor.unit.gchold``)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from supervisor.unit import gchold
from supervisor.unit.gchold import GcHold


@pytest.fixture(autouse=True)
def _collector_on():
    gc.enable()
    yield
    assert gchold._holders == 0, "a hold outlived its test"
    gc.enable()


async def test_holds_are_counted_and_the_last_release_turns_the_collector_back_on():
    one, two = GcHold(), GcHold()
    one.hold()
    one.hold()  # a second death of the same launch: still one hold
    two.hold()
    assert not gc.isenabled()
    one.release()
    assert not gc.isenabled(), "another unit still reads a death"
    one.release()  # released twice: no effect
    two.release()
    assert gc.isenabled()
    assert not one.held and not two.held


async def test_a_hold_whose_diagnosis_never_comes_ends_by_itself():
    hold = GcHold(max_s=0.05)
    hold.hold()
    assert not gc.isenabled()
    await asyncio.sleep(0.15)
    assert gc.isenabled() and not hold.held


async def test_a_collector_that_was_off_stays_off():
    gc.disable()
    hold = GcHold()
    hold.hold()
    hold.release()
    assert not gc.isenabled()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_settle_collects_the_cycles_a_launch_left_unless_a_death_is_being_read():
    gc.collect()
    gone: list[int] = []
    cycle = _Cycle()
    weakref.finalize(cycle, gone.append, 1)
    del cycle
    hold = GcHold()
    hold.hold()
    gchold.settle()
    assert gone == [], "no collection while a death is read"
    hold.release()
    gchold.settle()
    assert gone == [1]
