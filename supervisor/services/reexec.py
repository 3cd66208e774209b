"""Re-exec in place (docs/upgrade.md): the daemon's program replaced by the installed one,
the same pid, every server adopted where it stands.

``InPlace`` is the daemon's part of it: why it may not (``refusal``), the run itself (the
new code's check, a safe point, the queue held, the hand-over, the exec: ``run``), and the
new program's first word (``say_reexecuted``). The hand-over's I/O and the exec are the
``ReexecPort``'s; what each server hands over and adopts is its unit's (``ServerUnit.hand_over``,
``ServerUnit.start_background(adopt=...)``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

from supervisor.adapters.ports import ReexecPort, SdNotifier
from supervisor.aio import first_of
from supervisor.core import events as ev
from supervisor.core.config import Config
from supervisor.core.messages import FactsUpdated, GpuFree, KvPressure, KvSample, ProbeResult, TimerFired
from supervisor.core.state import Core, Timer

# A re-exec waits this long for every server to reach a safe point (a start-up in flight
# ends in READY or a crash); the hand-over's format, which a newer program may not read.
REEXEC_QUIET_S = 120.0
HANDOVER_VERSION = 1
REEXEC_TRIES = 3
# What a hand-over may leave unsaid, held while MQTT closes: a timer's due time is carried, a
# probe's answer or a sample is taken again by the next program. Anything else (a death, the
# outcome of a launch, stop or diagnosis, a task's failure) is a step the core must take first.
CARRIED = (TimerFired, ProbeResult, KvSample, GpuFree, FactsUpdated, KvPressure)


class Unit(Protocol):
    """What ``InPlace`` needs of a server's unit (``supervisor.unit.ServerUnit``)."""

    name: str
    cfg: Config
    core: Core | None
    adopted: bool
    why_not_adopted: str | None
    handed_over: dict[str, Any] | None  # the pid and launch adopted ({pid, attempt})

    def quiet(self) -> bool: ...
    def hand_over(self, fired: Sequence[Timer] = ()) -> dict[str, Any]: ...
    @property
    def kept_fds(self) -> list[int]: ...
    def resume(self) -> None: ...
    async def moved(self) -> None: ...


class Host(Protocol):
    """What ``InPlace`` needs of the daemon (``supervisor.daemon.Daemon``)."""

    @property
    def units(self) -> Sequence[Unit]: ...

    @property
    def stopping(self) -> bool: ...

    def emit(self, event: ev.Event, sinks: Sequence[ev.EventSink] | None = None) -> None: ...

    def requeue(self, item: Any) -> None: ...  # an item of the daemon's queue, back into it


class InPlace:
    """The daemon's re-execs (see the module docstring). ``held`` is not None while a hand-over
    holds the daemon's queue (its items kept, fed again if the exec does not happen)."""

    def __init__(self, host: Host, port: ReexecPort | None, notifier: SdNotifier, version: str) -> None:
        self.host = host
        self.port = port
        self.notifier = notifier
        self.version = version
        self.task: asyncio.Task[dict[str, Any]] | None = None
        self.held: list[Any] | None = None
        inherited = port.inherited if port is not None else None
        # monotonic times of the re-execs in the last hour (a bug re-execs at most 3 an hour)
        self.recent: list[float] = [float(t) for t in (inherited or {}).get("reexecs", [])]
        self.execs = int((inherited or {}).get("execs", 0))  # re-execs since systemd started it
        self.program_started = time.monotonic()  # this program's start (a re-exec's new one is later)

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def refusal(self) -> str | None:
        """Why this daemon cannot re-exec now (None: it can)."""
        if self.port is None:
            return "this daemon does not own its process (embedded): it cannot re-exec"
        if self.host.stopping:
            return "the daemon is stopping"
        if self.busy:
            return "a re-exec is already under way"
        return None

    def in_last_hour(self, now: float) -> int:
        return len([t for t in self.recent if now - t < 3600.0])

    def hello(self) -> dict[str, Any]:
        """``hello`` over the control socket: who answers (the CLI's ``reexec`` waits for a
        program started after the one it asked)."""
        return {"ok": True, "pid": os.getpid(), "version": self.version, "execs": self.execs,
                "program_started": self.program_started, "why_not": self.why_not_adopted(),
                "servers": [{"name": u.name, "state": str(u.core.state) if u.core else None,
                             "pid": u.core.pid if u.core else None,
                             "attempt": u.core.attempt if u.core else None, "adopted": u.adopted,
                             "handed_over": u.handed_over}
                            for u in self.host.units]}

    async def run(self, reason: str, *, quiet_s: float = REEXEC_QUIET_S, partial: bool = False) -> dict[str, Any]:
        """Check the installed code; wait for every server to be at a safe point (no launch,
        stop or diagnosis under way: bounded); hold the queue; hand over; exec. Returns only
        when refused or when the exec failed (the daemon then supervises on, unchanged).
        ``partial`` (a bug's): who is not at a safe point is relaunched by the next program."""
        port = self.port
        assert port is not None
        try:
            error = await self._until_held(port, quiet_s, partial)
        except asyncio.CancelledError:  # a stop came first: what was held is fed, MQTT is back for it
            if self.held is not None:
                self._release()
                await port.after_failed_exec()
                self.notifier.ready()
            raise
        if error is None:
            error = self._exec(port, reason)
            for unit in self.host.units:
                unit.resume()
            self._release()
            await port.after_failed_exec()
            self.notifier.ready()
        self.host.emit(ev.ReexecRefused(reason=reason, error=error))
        return {"ok": False, "error": error}

    async def _until_held(self, port: ReexecPort, quiet_s: float, partial: bool) -> str | None:
        """The queue held at a safe point, with MQTT closed (None), or why not."""
        error = await port.check()
        for attempt in range(REEXEC_TRIES):
            if error is not None:
                return error
            error = await self._until_quiet(quiet_s)
            if partial:
                error = None
            if error is not None:
                return error
            self.held = []
            self.notifier.reloading()
            await port.before_exec()
            moved = [item for item in self.held if _moves(item)]
            if not moved or partial:
                return None
            # A server moved while MQTT closed (a death, an answer the core waits for): that
            # step is fed, and the safe point waited for again.
            self._release()
            await port.after_failed_exec()
            self.notifier.ready()
            if attempt == REEXEC_TRIES - 1:
                return f"the servers kept moving ({_what(moved[0])} ...)"
        return error

    def _exec(self, port: ReexecPort, reason: str) -> str:
        """Hand over and exec; returns only when the exec failed, with why."""
        fired: dict[str, list[Any]] = {}
        for item in self.held or []:
            if isinstance(item, tuple) and isinstance(item[1], TimerFired):
                fired.setdefault(item[0].name, []).append(item[1].name)
        now = asyncio.get_running_loop().time()
        units: dict[str, dict[str, Any]] = {
            u.name: u.hand_over(fired.get(u.name, ())) if u.quiet() else
            {"unadoptable": f"it was {u.core.state if u.core else '-'}, mid-step, at the exec"}
            for u in self.host.units
        }
        doc = {
            "version": HANDOVER_VERSION, "pid": os.getpid(), "from_version": self.version, "reason": reason,
            "exec_at": now, "execs": self.execs + 1, "reexecs": [t for t in self.recent if now - t < 3600.0] + [now],
            "units": units,
        }
        self.host.emit(ev.ReexecHandingOver(reason=reason, pid=os.getpid(), servers=tuple(units)))
        try:
            port.exec(doc, [fd for u in self.host.units if "core" in units[u.name] for fd in u.kept_fds])
        except OSError as exc:
            return f"exec failed: {exc.strerror or exc}"
        return "the exec returned"

    def _release(self) -> None:
        """What was held for a hand-over that did not happen, fed after all, in order."""
        held, self.held = self.held or [], None
        for item in held:
            self.host.requeue(item)

    async def _until_quiet(self, timeout_s: float) -> str | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            busy = [u for u in self.host.units if not u.quiet()]
            if not busy:
                return None
            left = deadline - loop.time()
            if left <= 0:
                what = ", ".join(f"{u.name} {u.core.state if u.core else '-'}" for u in busy)
                return f"no safe point within {timeout_s:g} s (a launch, stop or diagnosis under way: {what})"
            await first_of({u.name: u.moved() for u in self.host.units}, timeout_s=left)

    # -- the new program ---------------------------------------------------------------------

    def why_not_adopted(self) -> str | None:
        port = self.port
        if port is None or (port.inherited is None and not port.inherited_error):
            return None
        return port.inherited_error or "; ".join(
            f"{u.name}: {u.why_not_adopted or 'not in the hand-over'}" for u in self.host.units if not u.adopted) or None

    def say_reexecuted(self) -> None:
        """The new program's first word, when it is one: who was adopted, who is relaunched
        and why, and how long from the exec."""
        port = self.port
        if port is None or (port.inherited is None and not port.inherited_error):
            return
        inherited = port.inherited or {}
        exec_at = inherited.get("exec_at")
        gap = asyncio.get_running_loop().time() - exec_at if isinstance(exec_at, int | float) else None
        self.host.emit(ev.Reexecuted(
            reason=str(inherited.get("reason") or "unknown"), from_version=str(inherited.get("from_version") or "?"),
            version=self.version, pid=os.getpid(), adopted=tuple(u.name for u in self.host.units if u.adopted),
            relaunching=tuple(u.name for u in self.host.units if not u.adopted), why_not=self.why_not_adopted(),
            gap_s=round(gap, 3) if gap is not None else None,
        ))


def _moves(item: Any) -> bool:
    return not isinstance(item, tuple) or not isinstance(item[1], CARRIED)


def _what(item: Any) -> str:
    return type(item[1]).__name__ if isinstance(item, tuple) else f"task {getattr(item, 'task', '?')} failed"
