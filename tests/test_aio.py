"""supervisor.aio: bounded waits and child tasks that never lose a cancellation.

The daemon that never exited after SIGTERM (issue 22): its GPU monitor's sample went through
``asyncio.wait_for``, which on Python 3.11 returns the result when its task is cancelled in
the same turn of the loop as the result arrives. The monitor's loop then ran on, and the
shutdown awaited it forever. These tests cancel exactly in that turn: a done-callback on the
awaited future cancels the waiting task, so the result and the cancellation arrive together.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import pytest

from supervisor.adapters.gpu import BoundedWorker, GpuMonitor
from supervisor.adapters.ports import GpuInfo
from supervisor.aio import cancel_and_wait, settled, where, within


async def _cancelled_as_it_resolves(wait: object) -> asyncio.Task[object]:
    """A task awaiting ``wait(fut)``, cancelled by ``fut``'s own done-callback as ``fut``
    resolves: the race that once kept a daemon alive, made deterministic."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    task = asyncio.create_task(wait(fut))  # type: ignore[operator]
    await asyncio.sleep(0)  # the task now waits on fut
    fut.add_done_callback(lambda _f: task.cancel())
    fut.set_result(7)
    await asyncio.wait({task})
    return task


async def test_within_keeps_a_cancellation_that_arrives_with_the_result() -> None:
    task = await _cancelled_as_it_resolves(lambda fut: within(asyncio.shield(fut), 5.0))
    assert task.cancelled()


async def test_the_race_is_real_asyncio_wait_for_loses_that_cancellation_on_311() -> None:
    """The same race against asyncio.wait_for: on 3.11 the task returns 7 as if never
    cancelled. This is what the test above would see without supervisor.aio.within. CPython
    3.12 rebuilt wait_for on asyncio.timeout (gh-86296), and there it keeps the cancellation."""
    task = await _cancelled_as_it_resolves(lambda fut: asyncio.wait_for(asyncio.shield(fut), 5.0))  # the bug itself
    if sys.version_info < (3, 12):
        assert not task.cancelled() and task.result() == 7
    else:
        assert task.cancelled()


async def test_a_gpu_sample_cancelled_as_its_answer_arrives_is_cancelled() -> None:
    """BoundedWorker.call (every NVML and simulated-GPU sample): the thread's answer and the
    task's cancellation in one turn. Before the fix the call returned the answer."""
    worker = BoundedWorker("test", 5.0)
    gate = threading.Event()
    task = asyncio.create_task(worker.call(lambda: gate.wait(5.0) and 42))
    while worker._pending is None:  # noqa: SLF001 - the future the thread settles
        await asyncio.sleep(0)
    worker._pending.add_done_callback(lambda _f: task.cancel())  # noqa: SLF001
    gate.set()
    await asyncio.wait({task}, timeout=5.0)
    assert task.cancelled()


async def test_a_bounded_worker_serves_every_call_on_one_thread_and_ends_it_when_let_go() -> None:
    """A sample a second must not start a thread a second: one thread answers every call, and
    it ends once nobody holds the worker."""
    worker = BoundedWorker("one-thread", 5.0)
    idents = {await worker.call(threading.get_ident) for _ in range(5)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    thread = next(t for t in threading.enumerate() if t.ident in idents)
    del worker
    gc.collect()
    thread.join(timeout=5.0)
    assert not thread.is_alive()


class _GatedProbe:
    """A GPU probe whose answer comes from a thread, like NVML's (through BoundedWorker),
    when the test opens the gate."""

    def __init__(self) -> None:
        self.worker = BoundedWorker("gated", 5.0)
        self.gate = threading.Event()

    async def sample(self) -> list[GpuInfo]:
        def read() -> list[GpuInfo]:
            self.gate.wait(5.0)
            return [GpuInfo(0, "GPU-0", "sim", 96 << 30, 90 << 30, 6 << 30)]

        return await self.worker.call(read)

    async def aclose(self) -> None:
        return None


async def test_a_gpu_monitor_cancelled_mid_sample_ends() -> None:
    """The daemon's view: the monitor's task, cancelled in the turn a sample's answer
    arrives, ends. Before the fix it went on sampling every interval, and the shutdown
    that awaited it never ended."""
    probe = _GatedProbe()
    monitor = GpuMonitor(probe, interval_s=0.01, low_free_bytes=1 << 30, emit=lambda _e: None)
    task = asyncio.create_task(monitor.run())
    while probe.worker._pending is None:  # noqa: SLF001 - the first sample is in flight
        await asyncio.sleep(0)
    probe.worker._pending.add_done_callback(lambda _f: task.cancel())  # noqa: SLF001 - cancel as it lands
    probe.gate.set()
    await asyncio.wait({task}, timeout=1.0)  # the one cancellation, as the shutdown sent it
    try:
        assert task.cancelled(), f"the monitor runs on after its cancellation: {where(task)}"
    finally:
        await cancel_and_wait([task], timeout_s=1.0)


def _stubborn(release: asyncio.Event) -> asyncio.Task[None]:
    """A task planted to ignore its cancellation until ``release`` is set."""

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:  # the planted bug: a swallowed cancellation
                continue

    return asyncio.create_task(stubborn(), name="stubborn")


async def test_cancel_and_wait_returns_a_task_that_ignores_its_cancellation() -> None:
    release = asyncio.Event()
    task = _stubborn(release)
    well = asyncio.create_task(asyncio.sleep(10), name="well-behaved")
    await asyncio.sleep(0)
    still = await cancel_and_wait([task, well], timeout_s=0.2)
    assert still == {task} and well.cancelled()
    text = where(task)
    assert text.startswith("stubborn: ") and "test_aio.py" in text and " stubborn" in text, text
    release.set()
    await asyncio.wait({task})


async def test_the_callers_own_cancellation_propagates_from_the_helpers() -> None:
    """Awaiting a child is where a CancelledError is expected; the caller's own must still
    propagate, from cancel_and_wait (while a child ignores its cancellation) and settled."""
    release = asyncio.Event()
    forever = asyncio.create_task(asyncio.Event().wait())
    stuck = _stubborn(release)
    await asyncio.sleep(0)
    for waiting in (settled(forever), cancel_and_wait([stuck])):
        parent = asyncio.create_task(waiting)
        await asyncio.sleep(0.01)
        parent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await parent
    assert not forever.done() and not stuck.done()
    release.set()
    forever.cancel()
    await asyncio.wait({forever, stuck})


async def test_settled_gives_a_childs_result_or_none() -> None:
    cancelled = asyncio.create_task(asyncio.sleep(10))
    await asyncio.sleep(0)
    cancelled.cancel()
    assert await settled(cancelled) is None
    assert await settled(asyncio.create_task(_fail())) is None
    assert await settled(asyncio.create_task(asyncio.sleep(0, "ok"))) == "ok"


async def _fail() -> None:
    raise ValueError("boom")
