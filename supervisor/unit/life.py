"""A launch's life, one at a time: spawn, watch, probe, stop, and the reading of its end.

``ServerLife`` holds what exists only while a server runs (its handle, its launch mark, the
parser of its start-up lines, its prober) and answers the core's actions with the core's
events: ``launch`` returns ``Launched`` or ``LaunchFailed``, ``probe`` a ``ProbeResult``,
``diagnose`` a ``Diagnosed``. What happens unasked (a line with start-up facts, a death)
is posted as it happens: ``FactsUpdated``, then ``Died`` at once when a process of the tree
dies. It decides nothing: what a death means, and whether its log is read, is the core's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import math
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.adapters.ports import KvReader, Prober, ProcessError, ServerHandle, UnitPorts
from supervisor.aio import TaskScope, within
from supervisor.core import events as ev
from supervisor.core.capacity import PEAK_STEP_GB
from supervisor.core.config import Config, http_url
from supervisor.core.diagnosis import diagnose
from supervisor.core.diagnosis.kv_pressure import KV_PRESSURE_WORDS, NOTHING_RETRACTED
from supervisor.core.diagnosis.launches import launch_marker
from supervisor.core.diagnosis.startup_facts import StartupFactsParser
from supervisor.core.messages import (
    Diagnosed,
    Died,
    Event,
    FactsUpdated,
    GpuFree,
    KvPressure,
    KvSample,
    Launch,
    Launched,
    LaunchFailed,
    ProbeResult,
    StopMode,
)
from supervisor.core.model import ExitStatus, Phase
from supervisor.core.ownership import LAUNCH_VAR, MARK_VAR, gpu_env, server_env
from supervisor.unit.gchold import GcHold, settle

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

KERNEL_LOG_TAIL = 256 * 1024
GIB = 1024**3
SPOTTED = tuple(words.encode() for _, words, _ in KV_PRESSURE_WORDS)  # read while serving
SPOT_EVERY_S = 1.0  # a retraction told at most once a second (SGLang may retract every step)
NOTHING_RAN = ExitStatus(code=None)
# The tree is looked at for new parts at every probe while the server starts (ranks and
# workers appear then), and once a minute while it serves: psutil reads every process of
# the host to find our descendants, the daemon's largest cost while serving (profiled on
# the real server: a third of it, at one probe every 10 s, on a host with ~200 processes).
TREE_SCAN_SERVING_S = 60.0

@dataclass(eq=False)
class LaunchLife:
    """One launch, from its spawn to its diagnosis. It owns its task scope (the spawn itself,
    the watch, the probes), ended as a whole when the launch is diagnosed, and everything
    that exists only while it runs: its handle, its mark, the parser of its start-up lines."""

    tasks: TaskScope
    nonce: str  # this launch's mark (ownership.LAUNCH_VAR)
    spawned: asyncio.Event = field(default_factory=asyncio.Event)  # the spawn ended, whichever way
    server: ServerHandle | None = None
    since: float | None = None  # wall time of the spawn (compared with process create times)
    facts: StartupFactsParser = field(default_factory=StartupFactsParser)
    ready_total: int | None = None  # the output's length when the server was last READY
    oom_kills_at_launch: int | None = None
    status: ExitStatus | None = None  # the main process's end, once the watch saw it
    least_free: tuple[float, ...] = ()  # GB per GPU since the launch (``ServerLife.least_free``)
    scanned_at: float = -math.inf  # loop time of the last scan of its tree for new parts
    spotted_at: float = -math.inf  # monotonic time of the last retraction told


class ServerLife:
    """The server's process while it runs (see the module docstring). ``cfg`` is replaced
    on a reload (the next launch uses it); ``prober`` makes the health prober, chosen when
    the unit is built (a group node >= 1 asks the group's head); ``tasks`` is the unit's
    scope, of which each launch's is a child."""

    def __init__(
        self, cfg: Config, ports: UnitPorts, *, instance_id: str, post: Callable[[Event], None],
        emit: Callable[[ev.Event], None], tasks: TaskScope, wall_now: Callable[[], str], log: FilteringBoundLogger,
        prober: Callable[[], Prober] | None = None,
    ) -> None:
        self.cfg = cfg
        self.p = ports
        self.log = log
        self.instance_id = instance_id
        self._post = post
        self._emit = emit
        self._wall_now = wall_now
        self._new_prober = prober or self._health_prober
        self.tasks = tasks
        self.run: LaunchLife | None = None  # the launch that runs (until it is diagnosed)
        self._prober: Prober | None = None
        self._kv: KvReader | None = None
        self._retired: list[Prober | KvReader] = []  # replaced by a reload, closed when the launch ends
        self.gc_hold = GcHold()  # from a death until its diagnosis is fed (ServerUnit.feed)

    @property
    def server(self) -> ServerHandle | None:
        return self.run.server if self.run is not None else None

    def reload(self, cfg: Config) -> None:
        self.cfg = cfg
        # A changed port or path is probed from the next probe on. The old probers are closed
        # when this launch ends (a probe may be using them now) or at close: the port lets a
        # prober hold a connection (the shipped one keeps none: adapters/http.py).
        self._retired += [old for old in (self._prober, self._kv) if old is not None]
        self._prober = None
        self._kv = None

    async def _close_retired(self) -> None:
        retired, self._retired = self._retired, []
        for old in retired:
            with contextlib.suppress(Exception):  # a session that cannot close is no reason to stop probing
                await old.aclose()

    def probe_tasks(self) -> TaskScope:
        """Where a probe runs: in the launch's scope, so that a late answer cannot speak for
        the next server."""
        return self.run.tasks if self.run is not None else self.tasks

    # -- spawn ------------------------------------------------------------------------------

    def begin(self, launch: Launch) -> LaunchLife:
        """A new launch's life (its scope a child of the unit's); ``launch`` spawns it. A last
        one that never spawned a server (its launch failed) ends here."""
        last = self.run
        if last is not None:
            self.tasks.spawn(self._end(last), f"end-launch-{launch.attempt - 1}")
        self.run = LaunchLife(self.tasks.child(f"launch-{launch.attempt}"), uuid.uuid4().hex[:16])
        return self.run

    async def launch(self, run: LaunchLife, launch: Launch, *,
                     about: tuple[tuple[str, ...], str] = ((), "")) -> Launched | LaunchFailed:
        """Spawn the server; ``about``: (its GPUs' names, its SGLang version), for the
        ``launch`` event (the report's header)."""
        cfg = self.cfg
        state_dir = Path(cfg.state.dir)
        log = self.p.open_log(
            cfg.logging.server_log or state_dir / "server.log",
            cfg.logging.server_log_max_bytes,
            cfg.logging.server_log_backups,
            on_error=lambda why: self._emit(ev.ServerLogWriteFailed(error=why)),
        )
        log.write(f"{launch_marker(launch.attempt, self._wall_now(), launch.argv)}\n".encode())
        mark = {MARK_VAR: self.instance_id, LAUNCH_VAR: run.nonce}
        env = server_env(cfg.server.pass_env, {**cfg.server.env, **gpu_env(cfg.gpu.indices)}, self.p.environ, mark)
        run.oom_kills_at_launch = await asyncio.to_thread(self._oom_kills)
        try:
            server = await self.p.spawner.spawn(
                launch.argv, env=env, cwd=cfg.server.cwd or str(state_dir), log=log,
                tail_bytes=cfg.logging.tail_bytes,
            )
        except ProcessError as exc:
            log.close()
            return LaunchFailed(str(exc))
        run.server = server
        run.since = time.time()  # wall clock, not monotonic: compared with processes' create times
        server.on_line = lambda line: self._on_line(run, line)
        server.on_part_died = lambda pid, title: self._died(Died(None, pid, title))
        server.spotted, server.on_spotted = SPOTTED, lambda line: self._on_spotted(run, line)  # once start-up is over
        self._emit(ev.ServerLaunched(
            argv=tuple(launch.argv), mem_fraction_static=launch.fraction, hicache_size_gb=launch.hicache_size_gb,
            attempt=launch.attempt, pid=server.pid, rung=launch.rung, launch_id=run.nonce,
            gpus=about[0], sglang_version=about[1],
        ))
        run.tasks.spawn(self._watched(run, server), "watch")
        settle()  # while the server loads: what the last launch and its end left is collected now
        return Launched(server.pid)

    def _on_line(self, run: LaunchLife, line: str) -> None:
        parser = run.facts
        if not parser.feed(line):
            return
        self._post(FactsUpdated(parser.facts))
        if parser.facts.ready and run.server is not None:
            run.server.on_line = None  # start-up is over: stop parsing lines

    def _on_spotted(self, run: LaunchLife, line: str) -> None:
        if NOTHING_RETRACTED in line:
            return
        now = time.monotonic()
        if now - run.spotted_at >= SPOT_EVERY_S:
            run.spotted_at = now
            source = next((src for _, words, src in KV_PRESSURE_WORDS if words in line), "retraction")
            self._post(KvPressure(source, line[-300:]))

    def least_free(self, sample: ev.GpuSample) -> GpuFree | None:
        """Each GPU's least free memory since this launch, when one of them fell lower (by
        ``PEAK_STEP_GB``): the peak the forward passes reached, as NVML sees it."""
        run = self.run
        if run is None:
            return None
        free = tuple(int(g["free_bytes"]) / GIB for g in sample.gpus)
        old = run.least_free
        least = free if len(old) != len(free) else tuple(map(min, free, old))
        if old and not any(new < was - PEAK_STEP_GB for new, was in zip(least, old, strict=True)):
            return None
        run.least_free = least
        return GpuFree(tuple(round(x, 3) for x in least))

    def mark_ready(self) -> None:
        """The server is READY: what its log holds now did not kill it while serving."""
        if self.run is not None and self.run.server is not None:
            self.run.ready_total = self.run.server.tail.total

    # -- watch ------------------------------------------------------------------------------

    async def _watched(self, run: LaunchLife, server: ServerHandle) -> None:
        """The main process's death is told at once; ``diagnose`` tidies what it left."""
        run.status = await server.wait()
        self._died(Died(run.status, server.pid))

    def _died(self, died: Died) -> None:
        """A death, posted at once; the collector is held off until its diagnosis is fed
        (``unit.gchold``: a full collection in the crash's path was its slowest 20 ms)."""
        self.gc_hold.hold()
        self._post(died)

    async def diagnose(self, read_log: bool, phase: Phase) -> Diagnosed:
        """The launch ends here: its tree is tidied (leftovers killed, output drained), its
        tasks end with its scope (a late probe answer must not speak for the next server),
        its log is read if the core asked, its handle closed."""
        run = self.run
        if run is None or run.server is None or run.status is None:
            return Diagnosed(NOTHING_RAN, None)
        server, status = run.server, run.status
        server.kill_leftovers()
        await server.drain_output(0.5)
        await self._end(run)
        diagnosis = None
        if read_log:
            kernel = await asyncio.to_thread(_read_tail, self.cfg.logging.kernel_log)
            oom_after = await asyncio.to_thread(self._oom_kills)
            before = run.oom_kills_at_launch
            delta = None if oom_after is None or before is None else max(0, oom_after - before)
            tail = server.tail.get()
            diagnosis = await asyncio.to_thread(
                diagnose, tail, exit_status=status, phase=phase, kernel_log=kernel, pids=server.tree_pids(),
                oom_kill_delta=delta, ready_at=_ready_at(run.ready_total, server.tail.total, tail),
                site_rules=self.cfg.diagnosis.rules,
            )
        await server.close()
        give_back_free_memory()
        return Diagnosed(status, diagnosis)

    async def _end(self, run: LaunchLife) -> None:
        if self.run is run:
            self.run = None
        await run.tasks.aclose()
        await self._close_retired()

    # -- probe ------------------------------------------------------------------------------

    def _health_prober(self) -> Prober:
        s = self.cfg.server
        return self.p.prober(http_url(s.host, s.port, self.cfg.health.path), self.cfg.health.timeout_s)

    async def probe(self, *, starting: bool, tree_grew: Callable[[], None], read_kv: bool = False) -> list[Event]:
        """The health answer; while starting, counted only when our tree holds the port.
        A probe also looks for new parts of the tree (``tree_grew`` when it found some:
        their pids and create times prove them ours after a daemon crash): each one while
        starting, one a minute while serving (``TREE_SCAN_SERVING_S``)."""
        if self._prober is None:
            self._prober = self._new_prober()
        run = self.run
        server = run.server if run is not None else None
        now = asyncio.get_running_loop().time()
        if run is not None and server is not None and (starting or now - run.scanned_at >= TREE_SCAN_SERVING_S):
            run.scanned_at = now
            known = len(server.tree_pids())
            server.watch_parts(await asyncio.to_thread(server.scan_descendants))
            if len(server.tree_pids()) != known:
                tree_grew()
        outcome = await self._prober.probe()
        ok, detail = outcome.ok, outcome.detail
        if ok and outcome.status is not None and server is not None and starting:
            # Readiness counts only when the listener on our port is our server's: a server
            # that fails to bind still sees its warm-up answered by whoever holds the port.
            ok, detail = await asyncio.to_thread(self._port_is_ours, server)
        self._emit(ev.ProbeAnswered(ok=ok, duration_s=round(outcome.duration_s, 4), status=outcome.status,
                                    error=None if ok else detail))
        result: list[Event] = [ProbeResult(ok, detail)]
        if read_kv and ok and self.p.kv_reader is not None:
            if self._kv is None:
                s = self.cfg.server
                self._kv = self.p.kv_reader(http_url(s.host, s.port, "/metrics"), self.cfg.health.timeout_s)
            reading = await self._kv.read()
            if reading is not None:
                result.append(KvSample(*reading))
        return result

    def _port_is_ours(self, server: ServerHandle) -> tuple[bool, str]:
        """(True, "") when a process of our server's tree listens on the port (blocking)."""
        port = self.cfg.server.port
        holders = self.p.cleanup.listeners(port)
        if holders & set(server.tree_pids()) or not holders:
            # No listener visible at all: /proc/net is not readable here; trust the answer.
            return True, ""
        return False, f"port {port} answered by pid {', '.join(map(str, sorted(holders)))}, not our server"

    # -- stop -------------------------------------------------------------------------------

    async def _spawned(self) -> ServerHandle | None:
        """The running launch's server, once its spawn ended (None: none, or it failed)."""
        run = self.run
        if run is None:
            return None
        await run.spawned.wait()
        return run.server

    async def stop(self, grace_s: float, reason: str, mode: StopMode, *,
                   out_of_router: Callable[[], Awaitable[None]]) -> Diagnosed | None:
        """Signal the server once the router stopped sending it requests; its end comes
        back through the watch (``Died``). None ran: ``Diagnosed`` at once."""
        server = await self._spawned()
        if server is None:
            return Diagnosed(NOTHING_RAN, None)  # the launch failed or had not happened
        await out_of_router()
        self.log.info("server_stopping", reason=reason, grace_s=grace_s, pid=server.pid, mode=mode)
        first = {StopMode.DRAIN: signal.SIGTERM, StopMode.DUMP: signal.SIGQUIT}.get(mode)  # AWAIT: none
        await server.stop(grace_s, first)
        return None

    async def leave(self, take_out: Callable[[], Awaitable[None]]) -> None:
        """The daemon is leaving: a live server (or one whose launch is in flight) is never
        left behind; out of the router first."""
        server = await self._spawned()
        if server is not None and server.returncode is None:
            with contextlib.suppress(TimeoutError):
                await within(take_out(), self.cfg.router.remove_wait_s)
            await server.stop(self.cfg.server.stop_grace_s)

    async def close(self) -> None:
        run = self.run
        if run is not None:
            if run.server is not None:
                await run.server.close()
            await self._end(run)
        if self._prober is not None:
            await self._prober.aclose()
        if self._kv is not None:
            await self._kv.aclose()
        await self._close_retired()

    # -- a re-exec (``unit.reexec``) ---------------------------------------------------------

    def hand_over(self) -> dict[str, Any] | None:
        """The running launch as the next daemon needs it (its pump stopped: what the server
        prints from here on waits in the pipe); None when no server runs."""
        run = self.run
        if run is None or run.server is None:
            return None
        return {
            "nonce": run.nonce, "since": run.since, "ready_total": run.ready_total,
            "oom_kills_at_launch": run.oom_kills_at_launch, "least_free": list(run.least_free),
            "server": {**(kept := run.server.hand_over()), "tail": base64.b64encode(kept["tail"]).decode()},
        }

    def resume(self) -> None:
        """The exec failed: the pump reads on."""
        if self.server is not None:
            self.server.resume()

    def adopt(self, doc: dict[str, Any], attempt: int) -> ServerHandle:
        """The launch a re-exec handed over, taken on where it stood: the same pipe read on
        into the same log, the tail and tree as they were, the watch of its end."""
        cfg = self.cfg
        s = doc["server"]
        log = self.p.open_log(
            cfg.logging.server_log or Path(cfg.state.dir) / "server.log", cfg.logging.server_log_max_bytes,
            cfg.logging.server_log_backups, on_error=lambda why: self._emit(ev.ServerLogWriteFailed(error=why)),
        )
        server = self.p.spawner.adopt(
            int(s["pid"]), int(s["pipe_fd"]), log=log, tail_bytes=cfg.logging.tail_bytes, tail=base64.b64decode(s["tail"]),
            tail_total=int(s["tail_total"]), known=[(int(p), float(t)) for p, t in s["known"]],
            parts=[(int(p), int(fd), str(title)) for p, fd, title in s["parts"]],
            known_started=[(int(p), int(t)) for p, t in s["known_started"]] if "known_started" in s else None,
        )
        run = self.run = LaunchLife(self.tasks.child(f"launch-{attempt}"), str(doc["nonce"]))
        run.spawned.set()
        run.server = server
        run.since = doc["since"]
        run.ready_total = doc["ready_total"]
        run.oom_kills_at_launch = doc["oom_kills_at_launch"]
        run.least_free = tuple(float(x) for x in doc["least_free"])
        server.on_part_died = lambda pid, title: self._died(Died(None, pid, title))
        server.spotted, server.on_spotted = SPOTTED, lambda line: self._on_spotted(run, line)
        run.tasks.spawn(self._watched(run, server), "watch")
        return server

    # -- what the state file keeps ----------------------------------------------------------

    def record(self, pid: int | None) -> dict[str, Any]:
        """The running server as the state file keeps it (``pid``: the core's, when no
        handle is held: a server a previous daemon left)."""
        run = self.run
        server = run.server if run is not None else None
        boot, starts = server.starts() if server else (None, [])
        return {
            "server_pid": server.pid if server else pid,
            "server_pgid": server.pgid if server else pid,
            "server_since": run.since if run and server else None,
            "server_started": server.started if server else None,  # `status`'s uptime, in this boot's ticks
            "server_launch": run.nonce if run and server else None,
            "server_tree": [list(t) for t in server.tree()] if server else [],
            # the same tree by start since boot, which no step of the wall clock moves
            # (adapters.procstart); a daemon before it reads ``server_tree`` alone
            "server_boot": boot,
            "server_tree_started": [list(t) for t in starts],
        }

    def last_output_at(self) -> float | None:
        return self.server.last_output_at if self.server else None

    def _oom_kills(self) -> int | None:
        """The cgroup's ``oom_kill`` count now (blocking; None when unreadable or off)."""
        path = self.cfg.logging.memory_events
        if path == "off":
            return None
        return self.p.oom_kills(path or None)


def give_back_free_memory() -> None:
    """What the heap has freed goes back to the system (glibc's ``malloc_trim``), after each
    diagnosis and once the diagnosis's tables are loaded (``Daemon.warm_diagnosis``).
    The diagnosis reads the whole tail in an executor thread, whose malloc arena keeps its
    high-water mark resident: each crash read in a new thread left ~1 MB more of RSS (the real
    soak: a step at each crash, flat between). The tables' load and the imports before it
    leave 1.2 MB free but resident (issue 36: 40.2 -> 39.1 MB serving). Elsewhere than glibc:
    nothing to do."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_FROM = 128 * 1024  # glibc's default threshold, kept fixed


def pin_malloc_thresholds() -> None:
    """glibc's mmap threshold kept at its default (128 KiB), not raised as it goes: by
    default, once a buffer that large is freed (a crash's tail, 256 KiB to 2 MiB, copied,
    decoded and lowered by its diagnosis), buffers that size come from the heap instead of
    their own mapping, and the heap keeps what they leave resident (the real soak's
    daemon: +1 MB at an incarnation's second crash, free in glibc's arenas). Fixed, each
    such buffer is mapped and unmapped whole. Called once at the daemon's start; elsewhere
    than glibc, nothing to do."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_FROM)
        libc.mallopt(M_TRIM_THRESHOLD, MMAP_FROM)


@functools.cache
def _libc() -> Any:
    """glibc, looked up once; None elsewhere (musl, macOS: neither call exists there)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - both or neither
    except (OSError, AttributeError):
        return None
    return libc


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
