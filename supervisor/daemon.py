"""The I/O shell around the pure core: pumps events in, carries actions out.

``Daemon.run()`` reads like a table of contents: take the state-directory lock, load what
was learned, tell systemd we supervise, then loop: one event at a time through the
``machine.step`` of the server it is for, each returned action carried out by that
server's ``ServerUnit`` (``supervisor.unit``). A daemon owns one server (``[server]``) or
several (``[[server]]``), each with its own state machine, GPUs, port and learned state;
what there is one of (the lock, signals, the control socket, systemd, rolling restarts)
lives here. Signal handlers only queue an event.

The daemon reaches the world only through its ports (``adapters.ports.Ports``: the store,
cleanup, preflight, the server spawner and its log, the health prober, the GPU monitor, the
control socket, the cgroup ``oom_kill`` reader, the orphan reaper); ``cli/run.py`` passes
the real adapters, tests their fakes. It imports the core, the ports and ``release`` (logic over the GPU
probe port), never a concrete adapter (import-linter's layers contract). A task
that fails (rather than being cancelled) ends the daemon, as in a ``TaskGroup``:
``daemon_failed``, the servers stopped, exit ``EXIT_DAEMON_FAILED`` for systemd to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from supervisor.adapters.ports import (
    ControlError,
    ControlHandle,
    ControlReply,
    NullNotifier,
    Ports,
    ReapedChild,
    ReaperError,
    ReaperHandle,
    SdNotifier,
    Store,
    StoreError,
)
from supervisor.aio import TaskScope, where, within
from supervisor.core import events as ev
from supervisor.core.config import Config, ConfigError, alert_instance, server_configs, unit_name
from supervisor.core.group import restart_refusal
from supervisor.core.messages import Boot, Event
from supervisor.services import maintenance
from supervisor.services.reexec import InPlace
from supervisor.services.rolling import PassEnd, another_serves, roll
from supervisor.unit import ServerUnit, wall_now
from supervisor.unit.handover import HandOver
from supervisor.unit.life import give_back_free_memory, pin_malloc_thresholds


async def watchdog_loop(
    notifier: SdNotifier,
    interval_s: float,
    alive: Callable[[], bool] | None = None,
    *,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> None:
    """Send ``WATCHDOG=1`` every ``interval_s`` from the event loop until cancelled.

    The pings come from the loop itself, so a blocked loop stops them. ``alive`` (optional)
    is asked before each ping: returning False withholds it, letting systemd restart a
    daemon whose loop turns but whose supervision is stuck. ``sleep`` waits between pings
    (``asyncio.sleep``; tests pass a simulated clock's to check the pace exactly).
    """
    if interval_s <= 0:
        raise ValueError(f"watchdog interval must be > 0, got {interval_s!r}")
    while True:
        if alive is None or alive():
            notifier.watchdog()
        await sleep(interval_s)


__all__ = ["EXIT_DAEMON_FAILED", "EXIT_SHUTDOWN_OVERDUE", "Daemon", "NullNotifier", "Ports", "shutdown_deadline_s",
           "wall_now"]


def shutdown_deadline_s(cfg: Config) -> float:
    """How long a stop may take, from the request to the process's end: the slowest
    server's planned stop (out of the router, then drained for ``stop_grace_s``) plus
    ``SHUTDOWN_MARGIN_S``. systemd's ``TimeoutStopSec`` must be longer (docs/systemd.md)."""
    slowest = max(u.server.stop_grace_s + (u.router.remove_wait_s if u.router.enabled else 0.0)
                  for u in server_configs(cfg))
    return slowest + SHUTDOWN_MARGIN_S

# A background task failed: the daemon stopped its server and exits with this code, which
# systemd's Restart=on-failure restarts (2 is reserved for "a restart cannot help").
EXIT_DAEMON_FAILED = 1
# The shutdown ran past its deadline: `shutdown_overdue` names what was still pending, and
# the process ends at once with this code (systemd sees a failed stop, not a hung one).
EXIT_SHUTDOWN_OVERDUE = 3
# A shutdown may take each server's drain (router removal, then stop_grace_s) plus this:
# the SIGKILL and reaping, the last alerts (MqttTransport.aclose: 5 s), etcd's lease revoked.
SHUTDOWN_MARGIN_S = 15.0
# A daemon bug (a task failed) re-execs at most this often an hour, after waiting this long
# for the servers' safe point; past that it exits as before, for systemd to restart.
BUG_REEXECS_PER_HOUR = 3
BUG_QUIET_S = 10.0
# Past the deadline the retained `offline` gets this long; a loop too blocked to run the
# deadline at all is ended by faulthandler (every thread's stack, exit 1) this much later.
OFFLINE_WAIT_S = 3.0
BLOCKED_LOOP_GRACE_S = 10.0


async def _until_done(queue: asyncio.Queue[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """A rolling pass's lines, as queued, through its last (``done``)."""
    while True:
        line = await queue.get()
        yield line
        if line.get("done"):
            return


@dataclass(frozen=True, slots=True)
class _TaskFailed:
    """A background task ended with an error (the shell's own event, never the core's)."""

    task: str
    error: BaseException
    final: bool = False  # a re-exec was tried for it and refused: the daemon exits


class Daemon:
    """The daemon: one process, one event loop, one or several servers (``ServerUnit``).

    It holds what there is one of: the state directory's lock, the signal handlers, the
    control socket, systemd's watchdog and status line, the queue that feeds every unit's
    core one event at a time, and the rolling restart that takes the servers through a
    planned restart one after the other (``restart [--server NAME]``).
    """

    def __init__(self, cfg: Config, ports: Ports) -> None:
        self.cfg = cfg
        self.p = ports
        self.log = ports.logger
        self.instance = alert_instance(cfg)
        self.exit_code: int | None = None
        self._queue: asyncio.Queue[tuple[ServerUnit, Event] | _TaskFailed] = asyncio.Queue()
        # Every task of the daemon is this scope's or a child's (each unit's, each launch's).
        self.tasks = TaskScope("daemon", on_failure=self._task_failed)
        self._control: ControlHandle | None = None
        self._failure: _TaskFailed | None = None  # the first background task that failed
        self._closing = False
        self._rolling: asyncio.Task[PassEnd] | None = None
        self._handing_over = asyncio.Lock()  # one inherited server replaced at a time (each unit's HandOver)
        self._followers: set[asyncio.Queue[dict[str, Any]]] = set()  # `restart`s waiting for the pass
        self._reaper: ReaperHandle | None = None
        self._deadline: asyncio.TimerHandle | None = None  # the shutdown's, armed by the first stop request
        self._stop_requested_at: float | None = None
        self._warmed = False  # the diagnosis's tables loaded (``warm_diagnosis``)
        # Re-exec in place: while one hands over, the queue's items are held (``inplace.held``).
        self.inplace = InPlace(self, ports.reexec, ports.notifier, _version())
        self.units = [self._unit(u) for u in server_configs(cfg)]

    def _unit(self, cfg: Config) -> ServerUnit:
        """One server's unit: its own ports, and its part in the hand-over of a server a
        killed daemon left (one unit at a time, once another serves). A single ``[server]``
        is a list of one, whose events carry no server label."""
        name = unit_name(cfg)
        handover = HandOver(
            turn=self._handing_over, timeout_s=cfg.health.startup_timeout_s,
            another_serves=lambda: another_serves([u for u in self.units if u.name != name]),
        )
        return ServerUnit(cfg, self.p.units(cfg), self, label=name if self.cfg.units else "", handover=handover)

    def unit(self, name: str) -> ServerUnit:
        return next(u for u in self.units if u.name == name)

    # -- the table of contents --------------------------------------------------------------

    async def run(self) -> int:
        try:
            acquired = self._lock()
        except StoreError as exc:
            self.log.error("daemon_refused", reason=str(exc))
            return 1
        pin_malloc_thresholds()
        try:
            self._install_signals()
            self._start_reaper()
            interval = self.p.notifier.watchdog_interval()
            if interval:
                self.spawn(watchdog_loop(self.p.notifier, interval), "watchdog")
            inherited = self.p.reexec.inherited if self.p.reexec is not None else None
            handed = (inherited or {}).get("units") or {}
            for unit in self.units:
                unit.start_background(adopt=handed.get(unit.name) if inherited is not None else None)
            await self._start_control()
            self.emit(ev.DaemonStarted(version=_version(), config=self.cfg.name, pid=os.getpid()))
            self.inplace.say_reexecuted()
            self.p.notifier.ready()
            for unit in self.units:
                if not unit.adopted:
                    unit.feed(Boot())
            while self.exit_code is None:
                item = await self._queue.get()
                if self.inplace.held is not None:
                    self.inplace.held.append(item)  # a re-exec is handing over: fed if its exec fails
                    continue
                if isinstance(item, _TaskFailed):
                    self._fail(item)
                    continue
                unit, event = item
                unit.feed(event)
                if all(u.exit_code is not None for u in self.units):
                    self.exit_code = max(u.exit_code or 0 for u in self.units)
        finally:
            await self._shutdown()
            for store in reversed(acquired):
                store.release()
        return self.exit_code

    def _lock(self) -> list[Store]:
        """The state directory's lock, then each server's own (several servers): a second
        daemon on the same config, or one server's directory, is refused."""
        acquired: list[Store] = []
        try:
            for store in (self.p.store, *(u.store for u in self.units if u.store is not self.p.store)):
                store.acquire()
                acquired.append(store)
        except StoreError:
            for store in reversed(acquired):
                store.release()
            raise
        return acquired

    # -- what units use (unit.Host) ---------------------------------------------------------

    def post(self, unit: ServerUnit, event: Event) -> None:
        """Queue an event for ``unit``'s core (safe from callbacks and signal handlers)."""
        self._queue.put_nowait((unit, event))

    def emit(self, event: ev.Event, sinks: Sequence[ev.EventSink] | None = None) -> None:
        """Out to the sinks: a server's event (stamped by its unit) to the daemon's sinks and
        ``sinks``, the server's own; a daemon-wide one (``sinks`` None), stamped with host
        and instance here, to every sink of every server. A rolling pass's steps also go to
        the ``restart`` commands that wait for it."""
        if sinks is None:
            event = replace(event, host=self.p.host, instance=self.instance)
            sinks = [sink for unit in self.units for sink in unit.sinks]
        for sink in (*self.p.sinks, *sinks):
            try:
                sink.emit(event)
            except Exception as exc:  # noqa: BLE001 - a broken sink must not stop supervision
                self.log.warning("sink_failed", sink=type(sink).__name__, error=repr(exc)[:200])
        if self._followers:
            if isinstance(event, ev.StateChanged):
                line: dict[str, Any] = {"server": event.server, "state": str(event.to)}
            elif isinstance(event, ev.RollingRestart):
                line = {"server": event.server, "step": event.step, "detail": event.detail}
            else:
                return
            for queue in self._followers:
                queue.put_nowait(line)

    async def others_serving(self, unit: ServerUnit) -> bool:
        """Whether a server besides ``unit`` takes traffic now (a climb's drain loses nothing)."""
        for other in self.units:
            if other is not unit and await other.serving():
                return True
        return False

    def warm_diagnosis(self) -> None:
        """At the first launch (a server STARTING, or READY when adopted across a re-exec),
        the diagnosis's tables (its rules, the catalogue's word index) are loaded in a
        thread, ~40 ms while the server loads its weights: a first crash, even one right
        after READY or at start-up, then reads its log as fast as the next one (issue 36), and
        the daemon's memory is its serving size from there on. A daemon whose every server is
        held never loads them."""
        if self._warmed:
            return
        self._warmed = True
        from supervisor.core.diagnosis import warm

        def load() -> None:
            warm()
            give_back_free_memory()

        self.spawn(asyncio.to_thread(load), "warm-diagnosis")

    def notify_status(self) -> None:
        self.p.notifier.status(" | ".join(u.status_text() for u in self.units))

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """A task of the daemon's own (the watchdog, a rolling pass)."""
        return self.tasks.spawn(coro, name)

    # -- signals, control, reload -----------------------------------------------------------

    def _install_signals(self) -> None:
        if not self.p.install_signals:
            return
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.request_stop, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        loop.add_signal_handler(signal.SIGUSR2, self.request_reexec, "SIGUSR2")

    def _start_reaper(self) -> None:
        """Become a child subreaper (PID 1 already is its namespace's) and collect the zombie
        children no one else waits for: orphans of our servers, or, as PID 1, of anything in
        the container. The servers' main processes are left to their watchers."""
        if self.p.reaper is None:
            return
        try:
            self._reaper = self.p.reaper(self._server_pids, self._on_reaped)
        except ReaperError as exc:
            # Supervision goes on; an orphan is then init's to reap and cleanup's to find.
            self.log.warning("reaper_unavailable", error=str(exc))
            return
        self.log.info("reaper_started", mode=self._reaper.mode, pid=os.getpid())

    def _server_pids(self) -> set[int]:
        """The server processes whose exit status is their watcher's (``ServerUnit._watch``)."""
        return {u.server.pid for u in self.units if u.server is not None}

    def _on_reaped(self, reaped: Sequence[ReapedChild]) -> None:
        self.emit(ev.OrphansReaped(pids=tuple(r.pid for r in reaped), names=tuple(r.name for r in reaped),
                                   returncodes=tuple(r.returncode for r in reaped)))

    def request_stop(self, reason: str) -> None:
        self._begin_stopping()
        if self.inplace.busy and self.inplace.task is not None:
            self.inplace.task.cancel()  # a stop wins over a re-exec not yet done: nothing held is lost
        if self._rolling is not None:
            self._rolling.cancel()
        for unit in self.units:
            unit.request_stop(reason)

    def request_restart(self, reason: str, server: str | None = None) -> dict[str, Any]:
        """A planned restart of one server, or of all of them one at a time (rolling)."""
        refused = restart_refusal(self.cfg)
        if refused is not None:
            return {"ok": False, "error": refused}
        if self._rolling is not None and not self._rolling.done():
            return {"ok": False, "error": "a rolling restart is already in progress"}
        units = self.units if server is None else [u for u in self.units if u.name == server]
        if not units:
            known = ", ".join(u.name for u in self.units)
            return {"ok": False, "error": f"no server {(server or '')[:64]!r} (known: {known})"}
        held = [u for u in units if u.core is not None and u.core.held is not None]
        if server is not None and held:
            return {"ok": False, "error": f"{server} is stopped by an operator: 'start --server {server}' launches it"}
        units = [u for u in units if u not in held]  # a pass over all leaves the held ones stopped
        if not units:
            return {"ok": False, "error": "every server is stopped by an operator: 'start' launches them"}
        before = [{"name": u.name, "state": str(u.core.state) if u.core else None,
                   "attempt": u.core.attempt if u.core else None} for u in units]
        self._rolling = self.spawn(roll(units, self.units, reason, self.emit), "rolling-restart")
        first = before[0]
        return {"ok": True, "state": first["state"], "attempt": first["attempt"], "servers": before}

    async def _start_control(self) -> None:
        """The control socket (``restart``); a daemon without one still supervises."""
        try:
            self._control = await self.p.start_control(self.cfg.state.dir, self._on_control)
        except ControlError as exc:
            self.log.warning("control_unavailable", error=str(exc))

    def _on_control(self, request: Mapping[str, Any]) -> dict[str, Any] | ControlReply:
        if request.get("cmd") == "reexec":
            reason = str(request.get("reason") or "requested over the control socket")[:200]
            answer = self.request_reexec(reason)
            task = self.inplace.task
            if request.get("wait") is True and answer.get("ok") and task is not None:
                # the check's outcome follows the acceptance: a refusal, or the connection
                # closes with the exec (the CLI then asks the new program, ``hello``)
                outcome: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
                task.add_done_callback(lambda t: outcome.put_nowait(
                    {"done": True, **(t.result() if not t.cancelled() and t.exception() is None
                                      else {"ok": False, "error": "the daemon is stopping"})}))
                return ControlReply(answer, _until_done(outcome), lambda: None)
            return answer
        if request.get("cmd") == "hello":
            return self.inplace.hello()
        if request.get("cmd") in (maintenance.STOP, maintenance.START):
            return self._maintenance(request)
        if request.get("cmd") == "restart":
            server = request.get("server")
            reason = str(request.get("reason") or "requested over the control socket")[:200]
            answer = self.request_restart(reason, server if isinstance(server, str) else None)
            if request.get("wait") is True and answer.get("ok") and self._rolling is not None:
                # `restart` returns when the pass is done, not when a state file says READY:
                # ``emit`` queues the pass's steps, the pass's end queues the last line
                queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
                self._followers.add(queue)
                names = [str(s["name"]) for s in answer["servers"]]
                self._rolling.add_done_callback(lambda task: queue.put_nowait(self._pass_ended(task, names)))
                return ControlReply(answer, _until_done(queue), lambda: self._followers.discard(queue))
            return answer
        return {"ok": False, "error": f"unknown command {str(request.get('cmd'))[:40]!r}"}

    def _maintenance(self, request: Mapping[str, Any]) -> dict[str, Any] | ControlReply:
        """``stop --server`` / ``start --server``: a hold, or its end, asked of each server named
        (all of them when none is); with ``wait``, each state they pass, then how it ended."""
        cmd, server = str(request.get("cmd")), request.get("server")
        reason = str(request.get("reason") or f"{cmd} requested over the control socket")[:200]
        refused = restart_refusal(self.cfg, cmd)
        if refused is not None:
            return {"ok": False, "error": refused}
        units = self.units if server is None else [u for u in self.units if u.name == server]
        if not units:
            known = ", ".join(u.name for u in self.units)
            return {"ok": False, "error": f"no server {str(server)[:64]!r} (known: {known})"}
        if server is None and cmd == maintenance.START:
            units = maintenance.startable(units)  # ``start`` alone: every server that is stopped
            if not units:
                return {"ok": False, "error": "no server is stopped by an operator or gave up: nothing to start"}
        refused = maintenance.refusal(cmd, units)
        if refused is not None:
            return {"ok": False, "error": refused}
        if self._rolling is not None and not self._rolling.done():
            self._rolling.cancel()  # an operator's stop or start supersedes a rolling pass
        before = maintenance.ask(cmd, units, reason)
        answer = {"ok": True, "servers": before}
        if request.get("wait") is not True:
            return answer
        return ControlReply(answer, maintenance.follow(cmd, units, before), lambda: None)

    # -- re-exec in place (docs/upgrade.md; ``services.reexec``) ----------------------------

    @property
    def stopping(self) -> bool:
        return self._closing or self.exit_code is not None

    def requeue(self, item: Any) -> None:
        self._queue.put_nowait(item)

    def request_reexec(self, reason: str) -> dict[str, Any]:
        """Re-execute the daemon in place, the servers serving on (``reexec``, SIGUSR2)."""
        refused = self.inplace.refusal()
        if refused is not None:
            self.emit(ev.ReexecRefused(reason=reason, error=refused))
            return {"ok": False, "error": refused}
        self.inplace.task = self.spawn(self.inplace.run(reason), "reexec")
        return {"ok": True, "pid": os.getpid(), "version": _version()}

    def _pass_ended(self, task: asyncio.Task[PassEnd], names: Sequence[str]) -> dict[str, Any]:
        """The last line for a ``restart`` that waits: how the pass ended, each server's state."""
        servers = [{"name": u.name, "state": str(u.core.state) if u.core else None,
                    "attempt": u.core.attempt if u.core else None} for u in self.units if u.name in names]
        if task.cancelled() or task.exception() is not None:
            return {"done": True, "ok": False, "detail": "the daemon is stopping: the pass ended there", "servers": servers}
        end = task.result()
        return {"done": True, "ok": end.ok, "detail": end.detail, "servers": servers}

    def _reload(self) -> None:
        if self.p.reload is None:
            return
        self.p.notifier.reloading()
        try:
            new = self.p.reload()
        except ConfigError as exc:
            self.emit(ev.ConfigReloaded(ok=False, error=str(exc)))
            self.p.notifier.ready()
            return
        units = server_configs(new)
        names = [unit_name(u) for u in units]
        if names != [u.name for u in self.units] or bool(new.units) != bool(self.cfg.units):
            # Never a server stopped because a new config was bad: the old one stays.
            self.emit(ev.ConfigReloaded(ok=False, error=(
                f"the servers changed ({', '.join(u.name for u in self.units)} -> {', '.join(names)}): "
                "adding, removing or renaming a server needs a restart of the daemon")))
        else:
            self.cfg = new
            self.emit(ev.ConfigReloaded(ok=True))
            for unit, unit_cfg in zip(self.units, units, strict=True):
                unit.reload(unit_cfg)
        self.p.notifier.ready()

    # -- failures and the end ---------------------------------------------------------------

    def _task_failed(self, task: asyncio.Task[Any]) -> None:
        """A task of any scope that ends with an error ends the daemon (like a ``TaskGroup``):
        the core may be waiting for the event it would have posted (``Diagnosed`` from a
        diagnosis) and would otherwise wait forever. A cancelled task (a launch's probe when
        the launch ends, shutdown) is not a failure."""
        exc = task.exception()
        if exc is None:
            return
        self.log.error("task_failed", task=task.get_name(), error=repr(exc)[:300])
        if not self._closing:
            self._queue.put_nowait(_TaskFailed(task.get_name(), exc))

    def _fail(self, failed: _TaskFailed) -> None:
        """Say so loudly; then re-exec in place, the servers serving on (at most
        ``BUG_REEXECS_PER_HOUR``), or leave: ``_shutdown`` stops the servers (drained, then
        killed, as on a normal stop), and the non-zero exit has systemd restart the daemon,
        which clears its own marked servers and relaunches."""
        if self.exit_code is not None:
            return
        error = repr(failed.error)[:300]
        now = asyncio.get_running_loop().time()
        if not failed.final and self.inplace.refusal() is None and self.inplace.in_last_hour(now) < BUG_REEXECS_PER_HOUR:
            self.log.error("daemon_bug", task=failed.task, error=error,
                           traceback="".join(traceback.format_exception(failed.error))[-4000:])
            self.emit(ev.DaemonFailed(task=failed.task, error=error, exit_code=EXIT_DAEMON_FAILED, reexec=True))
            self.inplace.task = self.spawn(self._bug_reexec(failed), "reexec")
            return
        self._failure = failed
        self.emit(ev.DaemonFailed(task=failed.task, error=error, exit_code=EXIT_DAEMON_FAILED))
        self.exit_code = EXIT_DAEMON_FAILED

    async def _bug_reexec(self, failed: _TaskFailed) -> dict[str, Any]:
        """A bug's re-exec: the servers at a safe point are adopted, the others (stuck in the
        step that failed) relaunched by the next program; refused, the daemon leaves as before."""
        answer = await self.inplace.run(f"task {failed.task} failed: {failed.error!r}"[:200], quiet_s=BUG_QUIET_S,
                                        partial=True)
        self._queue.put_nowait(replace(failed, final=True))
        return answer

    async def _shutdown(self) -> None:
        self._closing = True  # a task failing from here on is only logged
        self._begin_stopping()
        if self._control is not None:
            await self._control.close()
        reasons = {u.core.reason for u in self.units if u.core}
        reason = "; ".join(sorted(r for r in reasons if r)) or "error"
        if self._failure is not None:
            reason = f"task {self._failure.task} failed: {self._failure.error!r}"[:300]
        self.emit(ev.DaemonStopping(reason=reason))
        await asyncio.gather(*(u.leave() for u in self.units))
        # A task that ignores its cancellation holds this until the deadline says so.
        await self.tasks.aclose()
        for unit in self.units:
            await unit.close()
        if self._reaper is not None:
            self._reaper.close()

    # -- the shutdown's deadline ----------------------------------------------------------

    def _begin_stopping(self) -> None:
        """From the first stop request (or the daemon leaving on its own): ``STOPPING=1`` at
        once, before the servers drain (systemd shows the unit deactivating for the whole
        drain, not only for its last instant), and the whole stop, sinks included, has
        ``shutdown_deadline_s``; ``disarm`` when the process may end."""
        if self._deadline is not None:
            return
        self.p.notifier.stopping()
        loop = asyncio.get_running_loop()
        seconds = shutdown_deadline_s(self.cfg)
        self._stop_requested_at = loop.time()
        self._deadline = loop.call_later(seconds, self._overdue, seconds)
        if self.p.hard_exit is not None:
            # A loop too blocked to run the timer above: every thread's stack, then exit 1.
            faulthandler.dump_traceback_later(seconds + OFFLINE_WAIT_S + BLOCKED_LOOP_GRACE_S, exit=True)

    def disarm(self) -> None:
        """Everything is closed (the CLI's sinks too): the stop kept its deadline."""
        if self._deadline is not None:
            self._deadline.cancel()
        if self.p.hard_exit is not None:
            faulthandler.cancel_dump_traceback_later()

    def _overdue(self, seconds: float) -> None:
        """The stop ran past its deadline: one line naming every task still pending and
        where it waits, the retained ``offline`` if it can go, then the process ends."""
        pending = sorted((t for t in asyncio.all_tasks() if not t.done()), key=lambda t: t.get_name())
        self.log.error("shutdown_overdue", deadline_s=seconds, exit_code=EXIT_SHUTDOWN_OVERDUE,
                       pending=[where(t) for t in pending])
        self.exit_code = EXIT_SHUTDOWN_OVERDUE
        # the scopes are closing or closed by now, and this must run past them
        loop = asyncio.get_running_loop()
        loop.create_task(self._leave_now(), name="shutdown-overdue")  # outside any scope: see above

    async def _leave_now(self) -> None:
        if self.p.publish_offline is not None:
            try:
                await within(self.p.publish_offline(OFFLINE_WAIT_S), OFFLINE_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - leaving anyway; the broker's Last Will says offline too
                self.log.warning("offline_not_published", error=repr(exc)[:200])
        if self.p.hard_exit is None:
            return  # embedded in another program (tests): the line is said, the process is not ours to end
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stdout.flush()
        self.p.hard_exit(EXIT_SHUTDOWN_OVERDUE)


def _version() -> str:
    from supervisor import __version__

    return __version__
