"""One server's supervision: its pure state machine, and the I/O that carries it out.

A ``ServerUnit`` owns one SGLang server: its core (``machine.step``), its process, its
timers, its health probe, its GPUs' monitor, its state file, its place in SGLang's router.
Everything it does goes through the daemon's ports; events it posts go through the
daemon's one queue, tagged with the unit, so the daemon runs one step at a time over all
of them. A crash of one unit's server never reaches another: nothing here is shared but
the daemon's queue, its sinks and its task bookkeeping (``supervisor.daemon``).

Slow work (clearing the GPUs, probes, stopping the server) runs in tasks that post their
outcome back as events, so no adapter can delay a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import os
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from supervisor.adapters.ports import (
    GpuInfo,
    GpuProbe,
    GpuProbeError,
    Monitor,
    Ports,
    Prober,
    ProcessError,
    ServerHandle,
    Store,
    StoreError,
)
from supervisor.aio import settled, within
from supervisor.core import events as ev
from supervisor.core import machine
from supervisor.core.config import Config, alert_instance, http_url, unit_name, worker_url
from supervisor.core.diagnosis import diagnose
from supervisor.core.messages import (
    CancelTimer,
    ConfigChanged,
    Ctx,
    Emit,
    Exit,
    FactsUpdated,
    FleetShare,
    FleetShared,
    GpuLost,
    GroupReport,
    Launch,
    Launched,
    LaunchFailed,
    PartDied,
    Persist,
    Prepare,
    Prepared,
    PrepareFailed,
    Probe,
    ProbeResult,
    RestartRequested,
    RouterAdd,
    RouterRemove,
    ServerDied,
    ServerExited,
    SetTimer,
    StopMode,
    StopRequested,
    StopServer,
    TimerFired,
)
from supervisor.core.model import Cause, ExitStatus, State, rfc3339
from supervisor.core.ownership import LAUNCH_VAR, MARK_VAR, gpu_env, recorded_server, server_env
from supervisor.core.startup_facts import StartupFactsParser
from supervisor.core.state import Core, Learned, Timer
from supervisor.services import release
from supervisor.services.routing import RouterSync

if TYPE_CHECKING:
    from supervisor.services.fleet_sync import FleetSync
    from supervisor.services.grouping import GroupSync

KERNEL_LOG_TAIL = 256 * 1024


def wall_now() -> str:
    return rfc3339(_dt.datetime.now(_dt.UTC))



class Host(Protocol):
    """What a unit needs of the daemon that runs it (``supervisor.daemon.Daemon``)."""

    def post(self, unit: ServerUnit, event: machine.Event) -> None: ...

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]: ...

    def deliver(self, event: ev.Event, sinks: Sequence[ev.EventSink]) -> None: ...

    def notify_status(self) -> None: ...


class ServerUnit:
    """One server under supervision (see the module docstring).

    ``label`` is the server's name on its events (``server``; empty for a daemon with a
    single ``[server]``, whose events stay as they always were); ``store`` its state file;
    ``gpu_probe`` reads only its GPUs; ``sinks`` are its own (its metrics, its alerts),
    besides the daemon's.
    """

    def __init__(
        self, cfg: Config, ports: Ports, host: Host, *, label: str = "", store: Store,
        gpu_probe: GpuProbe, sinks: Sequence[ev.EventSink] = (),
    ) -> None:
        self.cfg = cfg
        self.p = ports
        self.host = host
        self.label = label
        self.name = unit_name(cfg)
        self.store = store
        self.gpu_probe = gpu_probe
        self.sinks = tuple(sinks)
        self.log = ports.logger.bind(server=label) if label else ports.logger
        self.instance = alert_instance(cfg)
        self.core: Core | None = None
        self.server: ServerHandle | None = None
        self.exit_code: int | None = None
        self._timers: dict[Timer, asyncio.TimerHandle] = {}
        self._moved = asyncio.Event()  # set, and replaced, at every step of the core (``moved``)
        self._launch_task: asyncio.Task[None] | None = None
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._recorded_pgid: int | None = None
        self._recorded_since: float | None = None  # wall time of that launch (pgid reuse guard)
        self._recorded_tree: list[tuple[int, float]] = []  # (pid, create time) seen in that tree
        self._server_since: float | None = None
        self._ready_total: int | None = None  # the output's length when the server was last READY
        self._store_failing = False
        self._facts: StartupFactsParser | None = None
        self._prober: Prober | None = None
        self._gpu_monitor: Monitor | None = None
        self._last_saved: dict[str, Any] | None = None
        # Our mark on every server we launch (ownership.MARK_VAR): what makes a process provably ours.
        self.instance_id = ports.cleanup.instance_id(cfg.state.dir)
        self._launch_nonce: str | None = None
        self._oom_kills_at_launch: int | None = None
        self._router: RouterSync | None = None  # SGLang's router's view of the server ([router])
        self._router_removal: asyncio.Task[None] | None = None
        self._group: GroupSync | None = None  # [group]: this node's part of the group
        self._fleet: FleetSync | None = None  # [fleet]: the record this server's fleet shares

    # -- the core -------------------------------------------------------------------------

    def post(self, event: machine.Event) -> None:
        """Queue an event for this unit's core (safe from callbacks and signal handlers)."""
        self.host.post(self, event)

    def feed(self, event: machine.Event) -> None:
        """One step of the core, then its actions, in order."""
        assert self.core is not None
        ctx = Ctx(now=asyncio.get_running_loop().time(), cfg=self.cfg, rng=self.p.rng, wall_time=wall_now())
        self.core, actions = machine.step(self.core, event, ctx)
        for action in actions:
            self._do(action)
        self._step_taken()

    def _step_taken(self) -> None:
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def moved(self) -> None:
        """Until the core takes its next step: what a waiter awaits instead of polling the
        state (the rolling restart)."""
        await self._moved.wait()

    # -- actions ----------------------------------------------------------------------------

    def _do(self, action: machine.Action) -> None:
        match action:
            case Emit(event=event):
                self.emit(event)
            case SetTimer(name=name, delay_s=delay):
                self._cancel_timer(name)
                loop = asyncio.get_running_loop()
                self._timers[name] = loop.call_later(max(0.0, delay), self._timer_fired, name)
            case CancelTimer(name=name):
                self._cancel_timer(name)
            case Persist():
                self._persist()
            case Prepare():
                self._spawn(self._prepare(), "prepare")
            case Launch() as launch:
                self._launch_task = self._spawn(self._launch(launch), "launch")
            case Probe():
                task = self._spawn(self._probe(), "probe")
                self._probe_tasks.add(task)
                task.add_done_callback(self._probe_tasks.discard)
            case StopServer(grace_s=grace, reason=reason, mode=mode):
                self._spawn(self._stop_server(grace, reason, mode), "stop")
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
            case FleetShare(entries=entries):
                if self._fleet is not None:
                    self._fleet.share(entries)

    def _timer_fired(self, name: Timer) -> None:
        """A timer is due: the core is told, with when the server last printed a line (what
        the startup-silence timer weighs; the others ignore it)."""
        self._timers.pop(name, None)
        server = self.server
        self.post(TimerFired(name, last_output_at=server.last_output_at if server else None))

    def emit(self, event: ev.Event) -> None:
        """Stamp ``event`` with our host, instance and server name; the daemon hands it to
        its sinks and ours."""
        event = replace(event, host=self.p.host, instance=self.instance, server=self.label)
        self.host.deliver(event, self.sinks)
        if isinstance(event, ev.StateChanged):
            self.host.notify_status()
            if event.to is State.READY and self.server is not None:
                self._ready_total = self.server.tail.total  # what the log held when it was last ready
            core = self.core
            if self._group is not None and core is not None:
                self._group.node_state(core.state, core.pid, core.generation)
        elif isinstance(event, ev.RouterRegistered | ev.RouterRemoved):
            self._persist()  # the worker id the router gave is kept in state.json

    async def serving(self) -> bool:
        """READY, and listed healthy by the router when there is one: it takes traffic."""
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
        text = (
            f"{core.state} fraction={fraction} restarts={core.learned.restarts}"
            f" last={core.last_cause or '-'}"
        )
        return f"{self.label}: {text}" if self.label else text

    # -- preparing a launch -----------------------------------------------------------------

    async def _prepare(self) -> None:
        """Clear our old servers off the GPUs, wait for memory, run preflight."""
        cfg = self.cfg
        try:
            gpus = await self._sample_or_none()
            holders = {p.pid: (g.index, p.used_bytes) for g in gpus for p in g.processes}
            report = await asyncio.to_thread(
                self.p.cleanup.find_stale,
                recorded_pgid=self._recorded_pgid,
                gpu_pids=list(holders),
                own_pid=os.getpid(),
                port=cfg.server.port,
                recorded_since=self._recorded_since,
                instance=self.instance_id,
                recorded_tree=self._recorded_tree,
            )
            for proc in report.foreign:
                index, used = holders.get(proc.pid, (None, None))
                self.emit(ev.ForeignGpuProcess(pid=proc.pid, name=proc.name, cmdline=proc.cmdline,
                                               reason=proc.reason, gpu=index, used_bytes=used))
            if report.port_holders and not cfg.gpu.kill_foreign:
                # Not ours (no mark, not our process group): reported, never killed.
                self.emit(ev.PortInUse(port=cfg.server.port,
                                       holders=tuple(p.to_dict() for p in report.port_holders)))
                who = ", ".join(f"pid {p.pid} {p.name or '?'}" for p in report.port_holders)
                self.post(PrepareFailed(Cause.PORT_IN_USE, f"port {cfg.server.port} is held by {who}, not ours"))
                return
            foreign = report.foreign or report.port_holders
            if report.ours or (foreign and cfg.gpu.kill_foreign):
                killed = await self.p.cleanup.kill_stale(
                    report, grace_s=min(cfg.server.stop_grace_s, 10.0), kill_foreign=cfg.gpu.kill_foreign
                )
                self.emit(ev.OrphansKilled(
                    pids=tuple(killed), titles=tuple(p.name for p in report.ours),
                    reasons=tuple(p.reason for p in report.ours),
                ))
            self._recorded_pgid = None
            self._recorded_tree = []
            if cfg.gpu.backend != "none":
                result = await release.wait_until_released(
                    self.gpu_probe,
                    min_free_share=cfg.gpu.free_share_min,
                    timeout_s=cfg.gpu.release_timeout_s,
                    poll_s=min(1.0, cfg.gpu.interval_s),
                )
                if result.error is not None and result.error.lost:
                    self.post(PrepareFailed(Cause.GPU_HW_ERROR, str(result.error), True))
                    return
                if result.error is not None:
                    # Degraded: we cannot see the GPUs, so we cannot prove them free. Launch
                    # anyway (the server's own startup OOM would tell) and say so once.
                    self.emit(ev.GpuProbeFailed(error=str(result.error), degraded=True, lost=False))
                elif not result.ok:
                    self.emit(result.stuck_event(cfg.gpu.release_timeout_s, self.core.learned.fraction if self.core else None))
                    detail = result.describe(cfg.gpu.free_share_min)
                    self.post(PrepareFailed(Cause.GPU_MEMORY_STUCK, detail, True))
                    return
            checks = await self.p.preflight.run_preflight(cfg, self.gpu_probe, degraded_ok=True)
            failed = [c for c in checks if not c.ok]
            if failed:
                self.emit(ev.PreflightFailed(
                    checks=tuple({"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks),
                    permanent=any(c.permanent for c in failed),
                ))
                detail = "; ".join(f"{c.name}: {c.detail}" for c in failed)
                # A model that is not there is the same finding SGLang would make a minute later.
                cause = Cause.MODEL_LOAD_ERROR if any(c.name == "model_path" for c in failed) else Cause.PREFLIGHT_FAILED
                self.post(PrepareFailed(cause, detail, any(c.permanent for c in failed)))
                return
            if self._fleet is not None:
                # What the fleet learned of this configuration, applied before the launch.
                self.post(await self._fleet.advice(cfg, gpus or await self._sample_or_none()))
            self.post(Prepared())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an adapter bug must not kill the daemon
            self.log.exception("prepare_failed", error=repr(exc)[:300])
            self.post(PrepareFailed(Cause.PREFLIGHT_FAILED, f"internal error: {exc!r}"[:300]))

    async def _sample_or_none(self) -> list[GpuInfo]:
        try:
            return await self.gpu_probe.sample()
        except GpuProbeError:
            return []

    # -- launching and watching -------------------------------------------------------------

    async def _launch(self, launch: Launch) -> None:
        cfg = self.cfg
        state_dir = Path(cfg.state.dir)
        log = self.p.open_log(
            cfg.logging.server_log or state_dir / "server.log",
            cfg.logging.server_log_max_bytes,
            cfg.logging.server_log_backups,
            on_error=lambda why: self.emit(ev.ServerLogWriteFailed(error=why)),
        )
        log.write(f"=== sglang-supervisor launch {launch.attempt} at {wall_now()}: {' '.join(launch.argv)}\n".encode())
        self._launch_nonce = uuid.uuid4().hex[:16]
        mark = {MARK_VAR: self.instance_id, LAUNCH_VAR: self._launch_nonce}
        env = server_env(cfg.server.pass_env, {**cfg.server.env, **gpu_env(cfg.gpu.indices)}, self.p.environ, mark)
        self._oom_kills_at_launch = await asyncio.to_thread(self._oom_kills)
        try:
            server = await self.p.spawner.spawn(
                launch.argv, env=env, cwd=cfg.server.cwd or str(state_dir), log=log,
                tail_bytes=cfg.logging.tail_bytes,
            )
        except ProcessError as exc:
            log.close()
            self.post(LaunchFailed(str(exc)))
            return
        self.server = server
        self._server_since = time.time()  # wall clock: compared with process create times
        self._ready_total = None
        self._facts = StartupFactsParser()
        server.on_line = self._on_server_line
        server.on_part_died = lambda pid, title: self.post(PartDied(pid, title))
        self.emit(
            ev.ServerLaunched(
                argv=tuple(launch.argv),
                mem_fraction_static=launch.fraction,
                hicache_size_gb=launch.hicache_size_gb,
                attempt=launch.attempt,
                pid=server.pid,
                rung=launch.rung,
                launch_id=self._launch_nonce,
            ),
        )
        self.post(Launched(server.pid))
        self._spawn(self._watch(server), "watch")

    def _on_server_line(self, line: str) -> None:
        parser = self._facts
        if parser is None:
            return
        if parser.feed(line):
            self.post(FactsUpdated(parser.facts))
            if parser.facts.ready and self.server is not None:
                self.server.on_line = None  # startup is over: stop parsing lines

    async def _watch(self, server: ServerHandle) -> None:
        """Wait for the server to end; clean its leftovers; diagnose; report."""
        status = await server.wait()
        self.post(ServerDied(status))  # the state changes now; the diagnosis follows
        server.kill_leftovers()
        await server.drain_output(0.5)
        for task in list(self._probe_tasks):
            task.cancel()  # a late answer must not speak for the next server
        assert self.core is not None
        phase = self.core.phase
        kernel = await asyncio.to_thread(_read_tail, self.cfg.logging.kernel_log)
        oom_after = await asyncio.to_thread(self._oom_kills)
        before = self._oom_kills_at_launch
        delta = None if oom_after is None or before is None else max(0, oom_after - before)
        tail = server.tail.get()
        diagnosis = await asyncio.to_thread(
            diagnose, tail, exit_status=status, phase=phase, kernel_log=kernel,
            pids=server.tree_pids(), oom_kill_delta=delta, ready_at=_ready_at(self._ready_total, server.tail.total, tail),
            site_rules=self.cfg.diagnosis.rules,
        )
        await server.close()
        if self.server is server:
            self.server = None
            self._facts = None
        self.post(ServerExited(status, diagnosis))

    def _new_prober(self) -> Prober:
        """``/health`` of our server; a group node >= 1's is the group's (``HeadProber``)."""
        if self._group is not None and self.cfg.group.node_rank > 0:
            return self._group.head_prober(alive=lambda: self.server is not None,
                                           ready=lambda: self.core is not None and self.core.state is State.READY)
        s = self.cfg.server
        return self.p.prober(http_url(s.host, s.port, self.cfg.health.path), self.cfg.health.timeout_s)

    async def _probe(self) -> None:
        if self._prober is None:
            self._prober = self._new_prober()
        server = self.server
        if server is not None:
            known = len(server.tree_pids())
            parts = await asyncio.to_thread(server.scan_descendants)
            server.watch_parts(parts)
            if len(server.tree_pids()) != known:
                self._persist()  # the tree's pids and create times prove them ours after a daemon crash
        outcome = await self._prober.probe()
        ok, detail = outcome.ok, outcome.detail
        if (ok and outcome.status is not None and server is not None and self.core is not None
                and self.core.state is State.STARTING):
            # Readiness counts only when the listener on our port is our server's: a server
            # that fails to bind still sees its warm-up answered by whoever holds the port.
            ok, detail = await asyncio.to_thread(self._port_is_ours, server)
        self.emit(ev.ProbeAnswered(ok=ok, duration_s=round(outcome.duration_s, 4), status=outcome.status,
                                   error=None if ok else detail))
        self.post(ProbeResult(ok, detail))

    def _port_is_ours(self, server: ServerHandle) -> tuple[bool, str]:
        """(True, "") when a process of our server's tree listens on the port (blocking)."""
        port = self.cfg.server.port
        holders = self.p.cleanup.listeners(port)
        tree = set(server.tree_pids())
        if holders & tree or not holders:
            # No listener visible at all: /proc/net is not readable here; trust the answer.
            return True, ""
        return False, f"port {port} answered by pid {', '.join(map(str, sorted(holders)))}, not our server"

    async def _stop_server(self, grace_s: float, reason: str, mode: StopMode = StopMode.DRAIN) -> None:
        if self._launch_task is not None:
            await settled(self._launch_task)
        server = self.server
        if server is None:
            # Nothing was running (the launch failed or had not happened): report it gone.
            self.post(ServerExited(ExitStatus(code=None), _nothing_ran()))
            return
        await self._router_removed()
        self.log.info("server_stopping", reason=reason, grace_s=grace_s, pid=server.pid, mode=mode)
        first = {StopMode.DRAIN: signal.SIGTERM, StopMode.DUMP: signal.SIGQUIT}.get(mode)  # AWAIT: none
        await server.stop(grace_s, first)  # the watch task reports the exit

    async def _router_removed(self) -> None:
        """A stop signals the server only once the router stopped sending it requests (the
        core put ``RouterRemove`` before ``StopServer``), or after ``[router] remove_wait_s``."""
        removal = self._router_removal
        if removal is None or removal.done():
            return
        with contextlib.suppress(TimeoutError):
            await within(settled(removal), self.cfg.router.remove_wait_s)

    # -- state ------------------------------------------------------------------------------

    def _load_state(self) -> str | None:
        """The core from what the state file learned; returns the router worker id it kept."""
        worker_id = None
        data, warning = self.store.load()
        if warning:
            self.log.warning("state_corrupt", detail=warning)
        learned = Learned.initial(self.cfg)
        if data:
            try:
                learned = Learned.from_dict(data["learned"]).rebased(self.cfg)
            except (KeyError, TypeError, ValueError) as exc:
                self.log.warning("state_unreadable", detail=f"{exc!r}"[:200])
            kept = data.get("router_worker_id")
            worker_id = kept if isinstance(kept, str) else None
            recorded = recorded_server(data)
            self._recorded_pgid = recorded["recorded_pgid"]
            self._recorded_since = recorded["recorded_since"]
            self._recorded_tree = recorded["recorded_tree"]
        self.core = Core.initial(learned)
        self._step_taken()
        return worker_id

    def _persist(self) -> None:
        core = self.core
        assert core is not None
        data = {
            "learned": core.learned.to_dict(),
            "state": str(core.state),
            "reason": core.reason,
            "server_pid": self.server.pid if self.server else core.pid,
            "server_pgid": self.server.pgid if self.server else core.pid,
            "server_since": self._server_since if self.server else None,
            "server_launch": self._launch_nonce if self.server else None,
            "server_tree": [list(t) for t in self.server.tree()] if self.server else [],
            "instance_id": self.instance_id,
            "router_worker_id": self._router.worker_id if self._router else None,
            "daemon_pid": os.getpid(),
            "attempt": core.attempt,
            "updated": wall_now(),
        }
        comparable = {k: v for k, v in data.items() if k != "updated"}
        if comparable == self._last_saved:
            return
        try:
            self.store.save(data)
            self._last_saved = comparable
            if self._store_failing:
                self.log.info("state_write_recovered", path=str(self.store.path))
            self._store_failing = False
        except StoreError as exc:
            if not self._store_failing:
                self.emit(ev.StateWriteFailed(error=str(exc)))
            self._store_failing = True

    # -- signals, reload, background --------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        self.post(StopRequested(reason))

    def request_restart(self, reason: str) -> None:
        self.emit(ev.RestartRequested(reason=reason))
        self.post(RestartRequested(reason))

    def _oom_kills(self) -> int | None:
        """The cgroup's ``oom_kill`` count now (blocking; None when unreadable or off)."""
        path = self.cfg.logging.memory_events
        if path == "off":
            return None
        return self.p.oom_kills(path or None)

    def reload(self, cfg: Config) -> None:
        """A new config (SIGHUP, already validated): the core applies it at the next launch."""
        self.cfg = cfg
        self._prober = None
        self.post(ConfigChanged())

    def start_background(self) -> None:
        """This server's GPU monitor and router sync; the state file is read first."""
        worker_id = self._load_state()
        if self.cfg.gpu.backend != "none":
            self._gpu_monitor = self.p.gpu_monitor(
                self.gpu_probe,
                interval_s=self.cfg.gpu.interval_s,
                low_free_bytes=int(self.cfg.gpu.low_free_warn_gb * 1024**3),
                emit=self.emit,
                on_lost=lambda exc: self.post(GpuLost(str(exc))),
            )
            self._spawn(self._gpu_monitor.run(), "gpu-monitor")
        if self.cfg.router.enabled and self.p.router is not None:
            self._router = RouterSync(
                self.p.router, worker_url(self.cfg), emit=self.emit, reconcile_s=self.cfg.router.reconcile_s,
                worker_id=worker_id, rng=self.p.rng,
            )
            self._spawn(self._router.run(), "router")
        if self.cfg.group.enabled and self.p.group_etcd is not None:
            from supervisor.services.grouping import GroupSync, node_config_hash  # only with [group] on

            self._group = GroupSync(
                self.p.group_etcd, self.cfg, config_hash=node_config_hash(self.cfg), host=self.p.host,
                post=self.post, emit=self.emit, rng=self.p.rng,
            )
            self._spawn(self._group.run(), "group")
        if self.cfg.fleet.enabled and self.p.fleet_store is not None and self.p.sglang_version is not None:
            from supervisor.services.fleet_sync import FleetSync  # only with [fleet] on

            self._fleet = FleetSync(
                self.p.fleet_store, self.p.sglang_version, prefix=self.cfg.fleet.prefix, host=self.p.host,
                emit=self.emit, shared=lambda entries: self.post(FleetShared(entries)), wall_now=wall_now,
                timeout_s=self.cfg.etcd.timeout_s, environ=self.p.environ, rng=self.p.rng,
            )
            self._spawn(self._fleet.run(), "fleet")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        return self.host.spawn(coro, f"{self.label}:{name}" if self.label else name)

    def _cancel_timer(self, name: Timer) -> None:
        handle = self._timers.pop(name, None)
        if handle is not None:
            handle.cancel()

    async def leave(self) -> None:
        """The daemon is leaving: timers off, and a live server never left behind (out of
        the router first). Its tasks are cancelled by the daemon next, then ``close``."""
        for name in list(self._timers):
            self._cancel_timer(name)
        if self._launch_task is not None:
            # A launch in flight (leaving after a failure): its server must not be missed below.
            await settled(self._launch_task)
        server = self.server
        if server is not None and server.returncode is None:
            if self._router is not None and self._router.wanted:
                with contextlib.suppress(TimeoutError):
                    await within(
                        self._router.take_out("the daemon is leaving", asyncio.get_running_loop().time()),
                        self.cfg.router.remove_wait_s,
                    )
            await server.stop(self.cfg.server.stop_grace_s)

    async def close(self) -> None:
        """After every task ended: close what this unit holds; a clean stop is recorded."""
        if self._group is not None:
            await self._group.aclose()
        if self.server is not None:
            await self.server.close()
        if self._prober is not None:
            await self._prober.aclose()
        with contextlib.suppress(Exception):
            await self.gpu_probe.aclose()
        if self.core is not None and self.core.state is State.STOPPED:
            self.core = replace(self.core, pid=None)
            self._step_taken()
            self._persist()
        self._facts = None


def _nothing_ran() -> Any:
    from supervisor.core.model import Diagnosis, Phase

    return Diagnosis(cause=Cause.OTHER, phase=Phase.STARTING, evidence=("no server process",))


def _ready_at(ready_total: int | None, total: int, tail: bytes) -> int | None:
    """Where in ``tail`` (a byte offset) the server was last READY: what it logged before
    then did not kill it while serving. None: it never was; 0: before the tail began."""
    if ready_total is None:
        return None
    return max(0, ready_total - (total - len(tail)))


def _read_tail(path: str) -> str | None:
    if not path:
        return None
    try:
        with Path(path).open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - KERNEL_LOG_TAIL))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None



