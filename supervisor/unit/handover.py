"""The server a killed daemon left behind, and what becomes of it (docs/router.md).

A daemon SIGKILLed (or run without systemd's cgroup kill) leaves its server running. The
next daemon finds it in the state file (``Recorded``: its process group, launch time and
tree, which prove its leftovers ours) and, at its first preparation:

- behind the router, still listed healthy: it serves for us until another server does
  (one unit at a time: the daemon's turn), then it is taken out of the router, drained for
  the whole stop grace period and stopped (``InheritedServer`` waiting, then replacing);
- otherwise its router entries are taken out at once (a dead URL takes no requests) and
  the stale-process cleanup stops it.

Why replace rather than adopt: its stdout is a pipe to the dead daemon, so a new daemon
could never read its next crash. ``HandOver`` is given to the unit when it is built; the
unit tells it what the state file recorded (``found``), the preparation asks it (``drain``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from supervisor.adapters.ports import Cleanup, StaleReport
from supervisor.aio import within
from supervisor.core import events as ev
from supervisor.core.config import Config

if TYPE_CHECKING:
    from supervisor.services.routing import RouterSync


@dataclass
class Recorded:
    """The last server a previous daemon recorded (its state file): what proves its
    leftovers ours (``cleanup.find_stale``)."""

    pgid: int | None = None
    since: float | None = None  # wall time of that launch (pgid reuse guard)
    tree: list[tuple[int, float]] = field(default_factory=list)  # (pid, create time) seen in that tree
    boot: str | None = None  # the boot it ran in (None: a state file from before it was kept)
    started: list[tuple[int, int]] = field(default_factory=list)  # (pid, start since that boot), the same tree


class HandOver:
    """One unit's part in the hand-over (see the module docstring). ``turn`` is the daemon's:
    one left-over server replaced at a time; ``another_serves`` says when a server other than
    this unit's takes traffic (False: none serves or is on its way)."""

    def __init__(self, *, turn: asyncio.Lock, another_serves: Callable[[], Awaitable[bool]],
                 timeout_s: float) -> None:
        self.recorded = Recorded()
        self.pending: StaleReport | None = None  # the left-over server, while it waits for its turn
        self.serving = False  # it serves for us behind the router until its turn
        self._turn = turn
        self._another_serves = another_serves
        self._timeout_s = timeout_s  # the longest wait for another server ([health] startup_timeout_s)
        self._router: RouterSync | None = None
        self._emit: Callable[[ev.Event], None] = lambda _event: None

    def found(self, recorded: Recorded, *, router: RouterSync | None, emit: Callable[[ev.Event], None]) -> None:
        """What the state file recorded, once loaded; the unit's router sync, if any."""
        self.recorded, self._router, self._emit = recorded, router, emit

    @property
    def left(self) -> bool:
        """A previous daemon's server is recorded and not cleared yet."""
        return self.recorded.pgid is not None

    def cleared(self) -> None:
        """Its leftovers are gone: from here on only our own launches count."""
        self.pending = None
        self.recorded = Recorded(since=self.recorded.since)

    async def drain(self, report: StaleReport) -> bool:
        """[router], first preparation: True when the left-over server was taken out of the
        router to be drained (it is then given the whole stop grace period)."""
        router = self._router
        if router is None:
            return False
        self.pending = report if report.ours else None
        loop = asyncio.get_running_loop()
        if not (report.ours and await router.listed_healthy()):
            await router.take_out("the last daemon's server is gone", loop.time())
            return False
        pgid = self.recorded.pgid
        self.serving = True
        self._emit(ev.InheritedServer(step="waiting", pgid=pgid, detail=(
            "the server the last daemon left still serves behind the router: replaced once another server serves")))
        try:
            async with self._turn:
                with contextlib.suppress(TimeoutError):
                    await within(self._another_serves(), self._timeout_s)
                self._emit(ev.InheritedServer(step="replacing", pgid=pgid, detail="out of the router, drained, stopped"))
                await router.take_out("replacing the server the last daemon left", loop.time())
        finally:
            self.serving = False
        return True

    async def listed_healthy(self) -> bool:
        """While it serves for us: whether the router still sends it requests."""
        return self.serving and self._router is not None and await self._router.listed_healthy()

    async def leave(self, cfg: Config, cleanup: Cleanup) -> None:
        """The daemon is leaving while the left-over server still waits for its turn: it is
        not left behind either (out of the router first)."""
        inherited = self.pending
        if inherited is None:
            return
        self.serving = False
        if self._router is not None:
            with contextlib.suppress(TimeoutError):
                await within(self._router.take_out("the daemon is leaving", asyncio.get_running_loop().time()),
                             cfg.router.remove_wait_s)
        await cleanup.kill_stale(inherited, grace_s=cfg.server.stop_grace_s)
        self.pending = None
