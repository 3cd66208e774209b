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

``Reconnect`` is the one reconnect loop of the package (etcd for a group and for the fleet,
SGLang's router, the MQTT broker): the project's one backoff, an attempt count that starts
again after a good session, and one report per outage (when it begins, and when it ends
with its duration), never one per retry.

Why not a library: ``stamina`` (on tenacity) retries a *call* until it succeeds, within an
attempt and time budget (10 tries, 45 s by default), and reports every retry to its hooks
(a log line, a counter, per retry). A session loop is the other shape: its "call" is a
connection that succeeds for hours and then breaks, the count must start again after a
good session rather than when a call returns, and an outage is reported once. Its jitter is
also added to the wait, not the project's window around it. A retry library would have to
be re-started per session and have its hooks silenced; this is the one loop, on the
project's own backoff, in less code than that glue, and with no new dependency.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from supervisor.core.backoff import exponential_backoff

T = TypeVar("T")

__all__ = ["Backoff", "Reconnect", "TaskScope", "cancel_and_wait", "first_of", "settled", "within"]


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


class TaskScope:
    """A task group that owns a lifetime: the daemon's, a server unit's, one launch's.

    Every task of the package's shell is started in one (``spawn``); a lifetime inside another
    is a ``child`` scope, ended with it. ``aclose`` cancels a scope's tasks and its children's,
    waits for them, and the scope takes no more. So a launch's probes
    and watcher die with the launch, and a unit's tasks with the unit, without anyone keeping
    a list of them.

    Why not ``asyncio.TaskGroup``: a task that fails here must not cancel its siblings
    mid-step (the servers' drains and stops are tasks too, and a failure ends the daemon
    through its ordinary stop, which drains them). A failure goes to ``on_failure`` of the
    nearest scope that has one (the daemon's: it ends the daemon that way). And a scope is
    opened in one task and closed in another (a launch begins in one and is diagnosed in the
    next), where a TaskGroup is one ``async with`` block.
    """

    def __init__(self, name: str, *, on_failure: Callable[[asyncio.Task[Any]], None] | None = None,
                 parent: TaskScope | None = None) -> None:
        self.name = name
        self._on_failure = on_failure
        self._parent = parent
        self._tasks: set[asyncio.Task[Any]] = set()
        self._children: set[TaskScope] = set()
        self.closed = False

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start ``coro`` as a task of this scope."""
        if self.closed:
            coro.close()
            raise RuntimeError(f"task scope {self.name!r} is closed: {name} not started")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def child(self, name: str, *, on_failure: Callable[[asyncio.Task[Any]], None] | None = None) -> TaskScope:
        """A scope whose tasks live no longer than this one's. Its failures go up to the
        nearest ``on_failure`` (given here: the child's owner reads them itself)."""
        scope = TaskScope(name, parent=self, on_failure=on_failure)
        if self.closed:
            scope.closed = True
        else:
            self._children.add(scope)
        return scope

    def tasks(self) -> list[asyncio.Task[Any]]:
        """This scope's tasks and its children's, still running or not yet reaped."""
        return [*self._tasks, *(t for c in self._children for t in c.tasks())]

    async def aclose(self, timeout_s: float | None = None) -> set[asyncio.Future[Any]]:
        """Cancel every task of the scope (and its children's), wait for them (at most
        ``timeout_s``), and take no more. Returns those that ignored their cancellation."""
        self.closed = True
        for scope in list(self._children):
            scope.closed = True
        still = await cancel_and_wait(self.tasks(), timeout_s)
        if self._parent is not None:
            self._parent._children.discard(self)
        return still

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        scope: TaskScope | None = self
        while scope is not None and scope._on_failure is None:
            scope = scope._parent
        if scope is not None and scope._on_failure is not None:
            scope._on_failure(task)


async def first_of(waits: dict[str, Coroutine[Any, Any, Any]], timeout_s: float | None = None) -> None:
    """Until the first of ``waits`` (by name) ends, or ``timeout_s`` passes; the others are
    cancelled: they live no longer than this call."""
    if not waits:
        return
    scope = TaskScope("first-of", on_failure=lambda _task: None)
    try:
        await asyncio.wait([scope.spawn(c, name) for name, c in waits.items()], timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        await scope.aclose()


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


# -- reconnecting ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Backoff:
    """A link's waits between tries: ``core.backoff.exponential_backoff`` (``initial *
    factor**n``, capped at ``maximum``, times a jitter drawn in ``jitter``)."""

    initial: float
    maximum: float
    factor: float = 2.0
    jitter: tuple[float, float] = (0.5, 1.0)

    def delay(self, attempt: int, sample: float) -> float:
        """The wait after failure number ``attempt`` (from 0) of an outage; ``sample`` in [0, 1)."""
        return exponential_backoff(attempt, initial=self.initial, factor=self.factor, maximum=self.maximum,
                                   jitter=self.jitter, sample=sample)


def _nothing(*_args: object) -> None:
    return None


class Reconnect:
    """One link's reconnects: sessions (or calls) one after another, a backoff between them.

    The rules, the same for every link:

    - the wait after a failure is ``backoff.delay(attempt)``, ``attempt`` counting the
      failures since the last good session: it grows to the cap while the link is away and
      starts again at 0 after a session that was good, that is one that reported
      ``connected()`` (its handshake done, a call answered) and then lasted ``good_after_s``
      (0: as soon as it connected). A link that accepts and drops at once keeps backing off;
    - an outage is reported once: ``on_down(error)`` at its first failure (a session that
      was up broke, or the very first try failed), ``on_up(down_s)`` when the link connects
      again, with the outage's duration (None: the first connection, no outage before it).
      Retries in between report nothing (the caller may count them, not log them).

    ``run(session)`` is the loop for a session that runs until it breaks; a caller whose
    tries are single calls (a periodic reconcile) uses ``connected()`` and ``failed(error)``
    itself and waits the delay ``failed`` returns. A cancellation is never caught: it ends
    ``run`` at once, whatever it was doing. ``clock``, ``sleep`` and ``rng`` are injected for
    tests (``sleep`` is only ``run``'s wait).
    """

    def __init__(
        self,
        link: str,
        backoff: Backoff,
        *,
        on_down: Callable[[BaseException], None] = _nothing,
        on_up: Callable[[float | None], None] = _nothing,
        good_after_s: float = 0.0,
        retry_on: type[Exception] | tuple[type[Exception], ...] = Exception,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.link = link
        self.backoff = backoff
        self._on_down = on_down
        self._on_up = on_up
        self._good_after_s = good_after_s
        self._retry_on = retry_on
        self._rng = rng or random.Random()
        self._clock = clock
        self._sleep = sleep
        self.attempt = 0  # failures since the last good session: the backoff's n
        self.up = False
        self._up_since: float | None = None
        self._down_since: float | None = None  # the current outage's start; None: not in one
        self.outages = 0

    @property
    def in_outage(self) -> bool:
        """An outage began (its ``on_down`` was reported) and has not ended."""
        return self._down_since is not None

    def connected(self) -> None:
        """The session is up (its handshake done) or the call answered: an outage ends here
        (``on_up``, once), and a session that lasts ``good_after_s`` resets the backoff."""
        now = self._clock()
        if self._good_after_s <= 0:
            self.attempt = 0
        if self.up:
            return
        self.up = True
        self._up_since = now
        down_s = None if self._down_since is None else round(max(0.0, now - self._down_since), 3)
        self._down_since = None
        self._on_up(down_s)

    def failed(self, error: BaseException) -> float:
        """A session broke or a try failed: the wait before the next try. The first failure
        of an outage reports it (``on_down``); the next ones only count."""
        now = self._clock()
        if self.up and self._up_since is not None and now - self._up_since >= self._good_after_s:
            self.attempt = 0  # a good session: this outage backs off from the start
        delay = self.backoff.delay(self.attempt, self._rng.random())
        self.attempt += 1
        if self.up or self._down_since is None:
            self.up = False
            self._up_since = None
            self._down_since = now
            self.outages += 1
            self._on_down(error)
        return delay

    async def run(self, session: Callable[[], Awaitable[object]]) -> None:
        """``await session()`` again and again, ``failed``'s wait after each failure (an
        exception of ``retry_on``), until a session returns: the caller's own end (a close).
        The session calls ``connected()`` once it is up."""
        while True:
            try:
                await session()
            except asyncio.CancelledError:
                raise
            except self._retry_on as exc:
                delay = self.failed(exc)
            else:
                return
            await self._sleep(delay)
