"""One server's supervision: its pure state machine, and the I/O that carries it out.

A ``ServerUnit`` owns one SGLang server. Its core (``machine.step``) decides; the unit
carries out each action and posts what came of it back as the core's next event:

- ``ServerLife`` (``unit.life``): the launch's life: spawn, watch, probe, stop, diagnose;
- ``Preparation`` (``unit.prepare``): our old servers off the GPUs, memory released,
  preflight, the fleet's advice;
- ``HandOver`` (``unit.handover``): the server a killed daemon left, given by the daemon;
- ``StateFile`` (``unit.statefile``): what is learned and what runs, on disk.

Two verbs cross the line between shell and core: ``post`` (an event into the daemon's one
queue, which feeds the cores one step at a time) and ``emit`` (an event out to the sinks).
The router, the group and systemd's status line follow the core's state by subscribing to
its changes (``_followers``). Slow work runs in tasks that post their outcome, so no
adapter can delay a decision; every task is the unit's (its ``TaskScope``, a child of the
daemon's) or its launch's (a child of the unit's, ended when the launch is diagnosed). A
crash of one unit's server never reaches another.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from supervisor.adapters.ports import Lease, Monitor, Prober, ServerHandle, UnitPorts
from supervisor.aio import TaskScope
from supervisor.core import codec, machine
from supervisor.core import events as ev
from supervisor.core.config import Config, alert_instance, unit_name, worker_url
from supervisor.core.messages import (
    Action,
    AskClimb,
    CancelTimer,
    ClimbAllowed,
    ConfigChanged,
    Ctx,
    Diagnose,
    Diagnosed,
    Emit,
    Event,
    Exit,
    FleetShare,
    FleetShared,
    GpuLost,
    GroupReport,
    HoldRequested,
    Launch,
    Persist,
    Prepare,
    Probe,
    RestartRequested,
    RouterAdd,
    RouterRemove,
    SetTimer,
    StartRequested,
    StopRequested,
    StopServer,
    TimerFired,
)
from supervisor.core.model import State, rfc3339
from supervisor.core.state import Core, Timer
from supervisor.services.routing import RouterSync
from supervisor.unit.handover import HandOver
from supervisor.unit.life import ServerLife
from supervisor.unit.prepare import Preparation
from supervisor.unit.statefile import StateFile

if TYPE_CHECKING:
    from supervisor.services.fleet_sync import FleetSync
    from supervisor.services.grouping import GroupSync


def _unfit(core: Core, life: Any) -> str | None:
    """Why a handed-over core and launch do not go together (None: they do)."""
    if (life is None) != (core.state is not State.READY):
        return f"a {core.state} server {'without' if life is None else 'with'} a running launch"
    if life is not None and life["server"]["pid"] != core.pid:
        return f"the launch's pid {life['server']['pid']} is not the core's {core.pid}"
    return None


def _close_fds(doc: Any) -> None:
    """The descriptors a hand-over names for a server that is not adopted: closed, so its
    pipe does not stay open and unread here (the server would stall once it is full)."""
    with contextlib.suppress(Exception):
        server = doc["life"]["server"]
        for fd in [server["pipe_fd"], *(part[1] for part in server["parts"])]:
            with contextlib.suppress(OSError, TypeError):
                os.close(int(fd))


def wall_now() -> str:
    return rfc3339(_dt.datetime.now(_dt.UTC))


class Host(Protocol):
    """What a unit needs of the daemon that runs it (``supervisor.daemon.Daemon``)."""

    tasks: TaskScope  # the daemon's: each unit's scope is a child of it

    def post(self, unit: ServerUnit, event: Event) -> None: ...

    def emit(self, event: ev.Event, sinks: Sequence[ev.EventSink] | None = None) -> None: ...

    def notify_status(self) -> None: ...

    async def others_serving(self, unit: ServerUnit) -> bool: ...

    def warm_diagnosis(self) -> None: ...


class ServerUnit:
    """One server under supervision (see the module docstring).

    ``label`` is the server's name on its events (``server``; empty for a daemon with a
    single ``[server]``, whose events stay as they always were); ``ports`` are its own (its
    state file, a probe of only its GPUs, its metrics and alerts besides the daemon's
    sinks) and the adapters all units share; ``handover`` is its part in replacing a server
    a killed daemon left.
    """

    def __init__(self, cfg: Config, ports: UnitPorts, host: Host, *, label: str = "", handover: HandOver) -> None:
        self.cfg = cfg
        self.p = ports
        self.host = host
        self.label = label
        self.name = unit_name(cfg)
        self.store = ports.store
        self.sinks = tuple(ports.sinks)
        self.handover = handover
        self.tasks = host.tasks.child(label or "server")
        self.log = ports.logger.bind(server=label) if label else ports.logger
        self.instance = alert_instance(cfg)
        self.core: Core | None = None
        self.exit_code: int | None = None
        # Our mark on every server we launch (ownership.MARK_VAR): what makes a process provably ours.
        self.instance_id = ports.cleanup.instance_id(cfg.state.dir)
        head = cfg.group.enabled and cfg.group.node_rank > 0  # node >= 1 asks the group's head
        self.life = ServerLife(
            cfg, ports, instance_id=self.instance_id, post=self.post, emit=self.emit, tasks=self.tasks,
            wall_now=wall_now, log=self.log, prober=self._head_prober if head else None,
        )
        self.prep: Preparation | None = None  # once started (``start_background``)
        self.state_file = StateFile(self.store, log=self.log, emit=self.emit, wall_now=wall_now)
        self._timers: dict[Timer, asyncio.TimerHandle] = {}
        self._moved = asyncio.Event()  # set, and replaced, at every step of the core (``moved``)
        self._followers: list[Callable[[Core], None]] = [
            lambda _core: self.host.notify_status(),
            lambda core: self.life.mark_ready() if core.state is State.READY else None,
            lambda core: self.host.warm_diagnosis() if core.state in (State.STARTING, State.READY) else None,
        ]
        self._gpu_monitor: Monitor | None = None
        self._router: RouterSync | None = None  # SGLang's router's view of the server ([router])
        self._router_removal: asyncio.Task[Any] | None = None
        self._group: GroupSync | None = None  # [group]: this node's part of the group
        self._fleet: FleetSync | None = None  # [fleet]: the record this server's fleet shares
        self.adopted = False  # taken on from a re-exec's hand-over, where it stood (no Boot)
        self.why_not_adopted: str | None = None
        # the pid and launch handed over (what ``reexec`` compares with, not what it saw
        # when it asked: a launch or stop under way then ends before the safe point)
        self.handed_over: dict[str, Any] | None = None  # {pid, attempt}

    @property
    def server(self) -> ServerHandle | None:
        """The server's process handle while one runs (``ServerLife.server``)."""
        return self.life.server

    # -- the core -------------------------------------------------------------------------

    def post(self, event: Event) -> None:
        """Queue an event for this unit's core (safe from callbacks and signal handlers)."""
        self.host.post(self, event)

    def feed(self, event: Event) -> None:
        """One step of the core (the daemon's loop, one event at a time), then its actions
        in order; the followers hear of a new state, pid or generation."""
        old = self.core
        assert old is not None
        local = time.localtime()
        ctx = Ctx(now=asyncio.get_running_loop().time(), cfg=self.cfg, rng=self.p.rng, wall_time=wall_now(),
                  local_minute=local.tm_hour * 60 + local.tm_min)
        self.core, actions = machine.step(old, event, ctx)
        for action in actions:
            self._do(action)
        if isinstance(event, Diagnosed):
            self.life.gc_hold.release()  # the death is read and told (unit.gchold)
        new = self.core
        if (new.state, new.pid, new.generation) != (old.state, old.pid, old.generation):
            for follow in self._followers:
                follow(new)
        self._step_taken()

    def _step_taken(self) -> None:
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def moved(self) -> None:
        """Until the core takes its next step: what a waiter awaits instead of polling the
        state (the rolling restart)."""
        await self._moved.wait()

    def emit(self, event: ev.Event) -> None:
        """Out to the sinks: the daemon's and ours, stamped with our host, instance and name."""
        self.host.emit(replace(event, host=self.p.host, instance=self.instance, server=self.label), self.sinks)

    # -- actions ----------------------------------------------------------------------------

    def _do(self, action: Action) -> None:
        life = self.life
        match action:
            case Emit(event=event):
                self.emit(event)
            case SetTimer(name=name, delay_s=delay):
                self._cancel_timer(name)
                self._timers[name] = asyncio.get_running_loop().call_later(max(0.0, delay), self._timer_fired, name)
            case CancelTimer(name=name):
                self._cancel_timer(name)
            case Persist():
                self._persist()
            case Prepare():
                assert self.prep is not None, "prepared before start_background"
                fraction = self.core.learned.fraction if self.core else None
                self._answer(self.prep.run(self.cfg, fraction), "prepare")
            case Launch() as launch:
                run = life.begin(launch)
                prep = self.prep
                about = (prep.gpu_names, prep.sglang_version) if prep is not None else ((), "")
                spawning = self._answer(life.launch(run, launch, about=about), "launch", run.tasks)
                spawning.add_done_callback(lambda _task: run.spawned.set())
            case Probe(read_kv=read_kv):
                starting = self.core is not None and self.core.state is State.STARTING
                self._answer(life.probe(starting=starting, tree_grew=self._persist, read_kv=read_kv), "probe",
                             life.probe_tasks())
            case AskClimb(fraction=fraction):
                self._answer(self._climb_allowed(fraction), "climb")
            case StopServer(grace_s=grace, reason=reason, mode=mode):
                self._answer(life.stop(grace, reason, mode, out_of_router=self._router_removed), "stop")
            case Diagnose(read_log=read_log, phase=phase):
                self._answer(life.diagnose(read_log, phase), "diagnose")
            case RouterAdd():
                if self._router is not None:
                    self._router.want_in(worker_url(self.cfg))
            case RouterRemove(reason=reason, at=at):
                if self._router is not None:
                    self._router_removal = self._spawn(self._router.take_out(reason, at), "router-remove")
            case GroupReport(generation=generation, diagnosis=diagnosis, exit=exit_text):
                if self._group is not None:
                    self._group.report(generation, diagnosis, exit_text)
            case Exit(code=code):
                self.exit_code = code
            case FleetShare() as wish:
                if self._fleet is not None:
                    self._fleet.share(wish)

    async def _climb_allowed(self, fraction: float) -> ClimbAllowed | None:
        """A climb drains this server: behind the router, only while another one serves."""
        if self._router is None or await self.host.others_serving(self):
            return ClimbAllowed(fraction)
        return None

    def _gpu_said(self, event: ev.Event) -> None:
        """The GPU monitor's news, out to the sinks; while serving, a new least free memory
        per GPU goes to the core (``ServerLife.least_free``)."""
        self.emit(event)
        core = self.core
        if isinstance(event, ev.GpuSample) and core is not None and core.state is State.READY:
            free = self.life.least_free(event)
            if free is not None:
                self.post(free)

    def _answer(self, work: Awaitable[Any], name: str, tasks: TaskScope | None = None) -> asyncio.Task[None]:
        """Run ``work`` in a task of ``tasks`` (the unit's by default) and post what it
        returns: an event, a list of them, or None (its outcome comes by another way)."""
        async def answer() -> None:
            outcome = await work
            for event in outcome if isinstance(outcome, list) else [outcome] if outcome is not None else []:
                self.post(event)

        return (tasks or self.tasks).spawn(answer(), self._task_name(name))

    def _timer_fired(self, name: Timer) -> None:
        """A timer is due: the core is told, with when the server last printed a line (what
        the start-up silence timer weighs; the others ignore it)."""
        self._timers.pop(name, None)
        self.post(TimerFired(name, last_output_at=self.life.last_output_at()))

    def _cancel_timer(self, name: Timer) -> None:
        handle = self._timers.pop(name, None)
        if handle is not None:
            handle.cancel()

    def _persist(self) -> None:
        core = self.core
        assert core is not None
        self.state_file.save(core, self.life.record(core.pid), instance_id=self.instance_id,
                             worker_id=self._router.worker_id if self._router else None)

    async def _router_removed(self) -> None:
        """A stop signals the server only once the router stopped sending it requests (the
        core put ``RouterRemove`` before ``StopServer``), or after ``[router] remove_wait_s``."""
        removal = self._router_removal
        if removal is not None and not removal.done():
            await asyncio.wait({removal}, timeout=self.cfg.router.remove_wait_s)

    def _head_prober(self) -> Prober:
        """A group node >= 1's health is the group head's READY in our generation."""
        assert self._group is not None, "[group] node >= 1 probes through the group's sync"
        return self._group.head_prober(alive=lambda: self.life.server is not None,
                                       ready=lambda: self.core is not None and self.core.state is State.READY)

    # -- what the daemon asks ---------------------------------------------------------------

    async def serving(self) -> bool:
        """READY, and listed healthy by the router when there is one: it takes traffic."""
        if self.handover.serving:
            return await self.handover.listed_healthy()  # the last daemon's server, until its turn
        core = self.core
        if core is None or core.state is not State.READY:
            return False
        return self._router is None or await self._router.routable()

    def status_text(self) -> str:
        """This server's part of systemd's STATUS= line."""
        core = self.core
        if core is None:
            return f"{self.label} -" if self.label else "-"
        fraction = "sglang" if core.learned.fraction is None else f"{core.learned.fraction:g}"
        text = f"{core.state} fraction={fraction} restarts={core.learned.restarts} last={core.last_cause or '-'}"
        return f"{self.label}: {text}" if self.label else text

    def request_stop(self, reason: str) -> None:
        self.post(StopRequested(reason))

    def request_restart(self, reason: str) -> None:
        self.emit(ev.RestartRequested(reason=reason))
        self.post(RestartRequested(reason))

    def request_hold(self, reason: str) -> None:
        """An operator's ``stop --server``: drained, stopped and kept stopped (the core's hold job)."""
        self.post(HoldRequested(reason))

    def request_start(self, reason: str) -> None:
        """An operator's ``start --server``: a held or given-up server launched again."""
        self.post(StartRequested(reason))

    def reload(self, cfg: Config) -> None:
        """A new config (SIGHUP, already validated): the core applies it at the next launch."""
        self.cfg = cfg
        self.life.reload(cfg)
        self.post(ConfigChanged())

    # -- start and end ----------------------------------------------------------------------

    def start_background(self, adopt: dict[str, Any] | None = None) -> None:
        """The state file is read; then this server's GPU monitor, router, group and fleet
        sync, each a task of the unit's; then its preparation, which knows the hand-over.
        ``adopt``: what a re-exec handed over for this server (``adopt``)."""
        loaded = self.state_file.load(self.cfg)
        self.core = Core.initial(loaded.learned, held=loaded.held, gave_up=loaded.gave_up)
        if adopt is not None:
            self.adopted, self.why_not_adopted = self._adopt(adopt)
        self._step_taken()
        cfg, p = self.cfg, self.p
        if cfg.gpu.backend != "none":
            self._gpu_monitor = p.gpu_monitor(
                p.gpu_probe, interval_s=cfg.gpu.interval_s, low_free_bytes=int(cfg.gpu.low_free_warn_gb * 1024**3),
                emit=self._gpu_said, on_lost=lambda exc: self.post(GpuLost(str(exc))),
            )
            self._spawn(self._gpu_monitor.run(), "gpu-monitor")
        if cfg.router.enabled and p.router is not None:
            self._router = RouterSync(
                p.router, worker_url(cfg), emit=self._router_said, reconcile_s=cfg.router.reconcile_s,
                worker_id=loaded.worker_id, rng=p.rng,
            )
            self._spawn(self._router.run(), "router")
        if cfg.group.enabled and p.group_etcd is not None:
            from supervisor.services.grouping import GroupSync, node_config_hash  # only with [group] on

            kept = (adopt or {}).get("group_lease") if self.adopted else None
            group = self._group = GroupSync(
                p.group_etcd, cfg, config_hash=node_config_hash(cfg), host=p.host, post=self.post, emit=self.emit,
                rng=p.rng, tasks=self.tasks, lease=Lease(int(kept[0]), int(kept[1])) if kept else None,
            )
            self._followers.append(lambda core: group.node_state(core.state, core.pid, core.generation))
            if self.adopted:
                group.node_state(self.core.state, self.core.pid, self.core.generation)
            self._spawn(group.run(), "group")
        if cfg.fleet.enabled and p.fleet_store is not None and p.sglang_version is not None:
            from supervisor.services.fleet_sync import FleetSync  # only with [fleet] on

            self._fleet = FleetSync(
                p.fleet_store, p.sglang_version, prefix=cfg.fleet.prefix, host=p.host, emit=self.emit,
                shared=lambda entries: self.post(FleetShared(entries)), wall_now=wall_now,
                timeout_s=cfg.etcd.timeout_s, environ=p.environ, rng=p.rng,
            )
            self._spawn(self._fleet.run(), "fleet")
        if self.adopted:
            core = self.core
            if core.state is State.READY and self._router is not None:
                self._router.want_in(worker_url(cfg))
        else:
            self.handover.found(loaded.recorded, router=self._router, emit=self.emit)
        self.prep = Preparation(p, instance_id=self.instance_id, handover=self.handover, fleet=self._fleet,
                                emit=self.emit, log=self.log)

    # -- a re-exec (docs/upgrade.md) ---------------------------------------------------------

    def quiet(self) -> bool:
        """At a point a re-exec can hand over as it stands: no job, no launch, stop or
        diagnosis under way; serving with its server alive, or waiting with none."""
        core = self.core
        if core is None or core.job is not None or core.queued is not None or self.handover.serving:
            return False
        run = self.life.run
        if core.state is State.READY:
            return run is not None and run.server is not None and run.status is None
        return core.state in (State.BACKOFF, State.STOPPED, State.GAVE_UP, State.WAITING) and run is None

    def hand_over(self, fired: Sequence[Timer] = ()) -> dict[str, Any]:
        """What the next daemon needs to adopt this server where it stands: the core, its
        timers' deadlines (monotonic: the clock runs on across an exec), the running launch
        (its pump stopped here). ``fired``: timers due but not yet told to the core."""
        core = self.core
        assert core is not None
        now = asyncio.get_running_loop().time()
        timers = {str(name): handle.when() for name, handle in self._timers.items()}
        timers.update({str(name): now for name in fired})
        lease = self._group.lease if self._group is not None else None
        return {"core": codec.encode(core), "timers": timers, "life": self.life.hand_over(),
                "group_lease": [lease.id, lease.ttl_s] if lease is not None else None}

    @property
    def kept_fds(self) -> list[int]:
        server = self.life.server
        return server.kept_fds if server is not None else []

    def resume(self) -> None:
        """The exec failed: the pump reads on."""
        self.life.resume()

    def _adopt(self, doc: dict[str, Any]) -> tuple[bool, str | None]:
        """The core and the launch a re-exec handed over, taken on where they stood: the core
        decided on nothing since, its timers run on at their deadlines, the server's output is
        read on from the same pipe. (False, why) when it cannot be: the server is then what
        a killed daemon would have left, stopped as a planned stop would and relaunched."""
        if "unadoptable" in doc:
            return False, str(doc["unadoptable"])[:300]
        try:
            core = codec.decode(Core, doc["core"])
            timers = {Timer(name): float(when) for name, when in doc["timers"].items()}
            life = doc["life"]
            unfit = _unfit(core, life)
            if unfit is None and life is not None:
                self.life.adopt(life, core.attempt)
        except (codec.CodecError, KeyError, TypeError, ValueError, OSError) as exc:
            _close_fds(doc)
            return False, f"{type(exc).__name__}: {exc}"[:300]
        if unfit is not None:
            _close_fds(doc)
            return False, unfit
        self.core = replace(core, learned=core.learned.rebased(self.cfg))
        self.handed_over = {"pid": core.pid, "attempt": core.attempt}
        loop = asyncio.get_running_loop()
        if core.state is State.READY and Timer.PROBE not in timers:
            timers[Timer.PROBE] = loop.time()  # its probe was in flight at the exec: probe again now
        for name, when in timers.items():
            self._timers[name] = loop.call_at(when, self._timer_fired, name)
        if core.state is State.READY:
            self.host.warm_diagnosis()
        return True, None

    def _router_said(self, event: ev.Event) -> None:
        """The router's news; the worker id it gave is kept in the state file."""
        self.emit(event)
        if isinstance(event, ev.RouterRegistered | ev.RouterRemoved):
            self._persist()

    def _task_name(self, name: str) -> str:
        return f"{self.label}:{name}" if self.label else name

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        return self.tasks.spawn(coro, self._task_name(name))

    async def leave(self) -> None:
        """The daemon is leaving: timers off, and a live server never left behind (out of
        the router first), nor one a killed daemon left that still waits for its turn. Its
        tasks end with its scope next (``close``)."""
        for name in list(self._timers):
            self._cancel_timer(name)
        await self.handover.leave(self.cfg, self.p.cleanup)
        await self.life.leave(self._take_out_for_leaving)

    async def _take_out_for_leaving(self) -> None:
        if self._router is not None and self._router.wanted:
            await self._router.take_out("the daemon is leaving", asyncio.get_running_loop().time())

    async def close(self) -> None:
        """The unit's tasks end (its scope, its launch's with it); then what it holds is
        closed, and a clean stop is recorded."""
        await self.tasks.aclose()
        self.life.gc_hold.release()
        if self._group is not None:
            await self._group.aclose()
        await self.life.close()
        with contextlib.suppress(Exception):
            await self.p.gpu_probe.aclose()
        if self.core is not None and self.core.state is State.STOPPED:
            self.core = replace(self.core, run=replace(self.core.run, pid=None))
            self._step_taken()
            self._persist()
