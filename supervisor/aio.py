"""Waiting with a bound, and ending child tasks, without ever losing a cancellation.

Two rules hold in the whole package (``tests/test_lint.py`` keeps them):

- **No ``asyncio.wait_for``.** On Python 3.11 it returns the awaited result when its own
  task is cancelled in the same turn of the loop as the result arrives, and the
  cancellation is lost (CPython gh-86296, fixed in 3.12). A loop built on it (the GPU
  monitor, a reconnect loop) then runs on after it was cancelled, and whoever awaits it
  waits forever: a daemon once never exited after SIGTERM that way. ``within`` is the
  same bound on ``asyncio.timeout``, which keeps the cancellation.
- **A task never swallows its own cancellation.** It may catch it to clean up, then
  re-raises. The one place where a ``CancelledError`` is expected and dropped is awaiting
  a *child* task that was cancelled on purpose: ``cancel_and_wait`` and ``settled`` do
  that, and raise when the caller itself is cancelled while it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["cancel_and_wait", "settled", "within"]


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """``await aw``, raising ``TimeoutError`` after ``seconds`` (``None``: no bound).

    Like ``asyncio.wait_for`` (``aw`` is cancelled on timeout; shield it to keep it), but a
    cancellation of the caller always propagates, even when ``aw`` finished in the same turn.
    """
    async with asyncio.timeout(seconds):
        return await aw


async def settled(task: asyncio.Future[T]) -> T | None:
    """Wait for a child ``task`` to end, however it ends: its result, or ``None`` when it
    was cancelled or failed (its error is then the task's owner's to report: it is marked
    as read here). Only the caller's own cancellation is raised."""
    await asyncio.wait({task})
    if task.cancelled():
        return None
    if task.exception() is not None:
        return None
    return task.result()


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], timeout_s: float | None = None) -> set[asyncio.Future[Any]]:
    """Cancel ``tasks`` and wait until they end (at most ``timeout_s``).

    Returns those still running at the deadline: tasks that ignore their cancellation
    (empty when all ended). Their errors are the owner's to report (``settled``). The
    caller's own cancellation propagates; the children's is the one expected here.
    """
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    for task in pending:
        task.cancel()
    still: set[asyncio.Future[Any]] = set()
    if pending:
        _done, still = await asyncio.wait(pending, timeout=timeout_s)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # read: an error while it was cancelled is not "never retrieved"
    return still


def where(task: asyncio.Task[Any]) -> str:
    """Where a pending ``task`` waits, for a person: its name, each frame of its await chain
    (``Task.get_stack()``'s frame, then the coroutines it awaits, innermost last) as
    ``file:line function``, and what the innermost one waits on."""
    frames = [_frame(f) for f in task.get_stack()]
    awaited: Any = getattr(task.get_coro(), "cr_await", None)
    leaf: Any = None
    for _ in range(64):
        if awaited is None:
            break
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is not None:
            frames.append(_frame(frame))
        following = (getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
                     or getattr(awaited, "ag_await", None))
        if following is None:
            leaf = awaited if frame is None else None
            break
        awaited = following
    text = f"{task.get_name()}: {' > '.join(frames) or '(not started)'}"
    if leaf is not None and type(leaf).__name__ != "FutureIter":  # a future's iterator says nothing more
        text += f" awaiting {_short(leaf)}"
    return text


def _frame(frame: Any) -> str:
    path = str(frame.f_code.co_filename)
    for marker in ("/supervisor/", "/site-packages/", "/asyncio/"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 160 else text[:157] + "..."
