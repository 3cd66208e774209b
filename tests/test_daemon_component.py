"""The daemon's shell driven through fake ports: no subprocess, no socket, no GPU.

Each test runs a real ``Daemon`` (the real core, the real event loop) whose adapters are the
fakes below, under a deadline of a few seconds; the server is a ``FakeServer`` the test ends
when it wants to.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from fakeports import fake_ports

from supervisor.adapters.ports import ProbeOutcome, StaleReport
from supervisor.adapters.store import StoreError
from supervisor.aio import within
from supervisor.core.config import (
    Config,
    HealthConfig,
    LoggingConfig,
    PolicyConfig,
    RouterConfig,
    ServerConfig,
    StateConfig,
)
from supervisor.core.diagnosis.launches import split_launches
from supervisor.core.events import Event
from supervisor.core.model import ExitStatus, State
from supervisor.daemon import EXIT_DAEMON_FAILED, Daemon

DEADLINE_S = 5.0


# -- fakes ---------------------------------------------------------------------------------


class Recorder:
    """An event sink that keeps every event; a test awaits the next one (``emitted``) instead
    of polling: every step of the daemon that changes anything emits an event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._next: asyncio.Event | None = None

    def emit(self, event: Event) -> None:
        self.events.append((event.kind, event.fields()))
        waiting, self._next = self._next, None
        if waiting is not None:
            waiting.set()

    async def emitted(self, timeout_s: float = 0.1) -> None:
        """Until the next event (at most ``timeout_s``: a fake's own state may change
        without one)."""
        if self._next is None:
            self._next = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await within(self._next.wait(), timeout_s)

    def find(self, name: str) -> list[dict[str, Any]]:
        return [f for e, f in self.events if e == name]


class Logger:
    """A structlog-shaped logger that keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        def log(event: str, **fields: Any) -> None:
            self.lines.append((level, event, fields))

        return log

    def find(self, event: str) -> list[dict[str, Any]]:
        return [f for _level, e, f in self.lines if e == event]


class FakeStore:
    def __init__(self, path: Path) -> None:
        self.path = path / "state.json"
        self.failing = False
        self.saves: list[dict[str, Any]] = []
        self.attempts = 0
        self.released = False

    def acquire(self) -> None: ...

    def release(self) -> None:
        self.released = True

    def load(self) -> tuple[dict[str, Any] | None, str | None]:
        return None, None

    def save(self, data: dict[str, Any]) -> None:
        self.attempts += 1
        if self.failing:
            raise StoreError(f"{self.path}: No space left on device")
        self.saves.append(data)


class FakeTail:
    total = 0

    def get(self) -> bytes:
        return b""


class FakeServer:
    """A server that runs until the test (``exit``) or a stop ends it."""

    def __init__(self, pid: int) -> None:
        self.pid = self.pgid = pid
        self.tail = FakeTail()
        self.last_output_at = asyncio.get_running_loop().time()
        self.on_line: Callable[[str], None] | None = None
        self.spotted: tuple[bytes, ...] = ()
        self.on_spotted: Callable[[str], None] | None = None
        self.on_part_died: Callable[[int, str], None] | None = None
        self.returncode: int | None = None
        self.stopped_with: list[signal.Signals | None] = []
        self.closed = False
        self._ended: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()

    def exit(self, code: int) -> None:
        self.returncode = code
        if not self._ended.done():
            self._ended.set_result(ExitStatus.from_returncode(code))

    def break_wait(self, exc: BaseException) -> None:
        """Make ``wait()`` fail (the watcher dies); the server itself keeps running."""
        self._ended.set_exception(exc)

    async def wait(self) -> ExitStatus:
        return await self._ended

    def kill_leftovers(self) -> list[int]:
        return []

    async def drain_output(self, timeout_s: float) -> None: ...

    def scan_descendants(self) -> list[tuple[int, str]]:
        return []

    def watch_parts(self, parts: Sequence[tuple[int, str]]) -> None: ...

    def tree_pids(self) -> list[int]:
        return [self.pid]

    def tree(self) -> list[tuple[int, float]]:
        return []

    def starts(self) -> tuple[str, list[tuple[int, int]]]:
        return "", []

    @property
    def started(self) -> int | None:
        return None

    async def stop(self, grace_s: float, first: signal.Signals | None = signal.SIGTERM) -> ExitStatus:
        self.stopped_with.append(first)
        if self.returncode is None:
            self.exit(-(first or signal.SIGKILL))
        return ExitStatus.from_returncode(self.returncode or 0)

    async def close(self) -> None:
        self.closed = True


class FakeSpawner:
    """Starts FakeServers; while ``gate`` is set, a launch waits for it (a launch in flight)."""

    def __init__(self) -> None:
        self.servers: list[FakeServer] = []
        self.logs: list[FakeLog] = []  # each launch's server log
        self.gate: asyncio.Event | None = None
        self.spawning = asyncio.Event()

    async def spawn(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None, log: Any,
                    tail_bytes: int) -> FakeServer:
        self.spawning.set()
        if self.gate is not None:
            await self.gate.wait()
        server = FakeServer(1000 + len(self.servers))
        self.servers.append(server)
        self.logs.append(log)
        log.close()
        return server


class FakeProber:
    """Answers from ``answers`` (per call: a bool, or an Event to wait for, then 200); then ``default``."""

    def __init__(self, default: bool = False) -> None:
        self.default = default
        self.answers: list[Any] = []
        self.calls = 0
        self.cancelled = 0

    async def probe(self) -> ProbeOutcome:
        self.calls += 1
        answer = self.answers.pop(0) if self.answers else self.default
        try:
            if isinstance(answer, asyncio.Event):
                await answer.wait()
                answer = True
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return ProbeOutcome(answer, 200 if answer else None, 0.001, "ok" if answer else "connection refused")

    async def aclose(self) -> None: ...


class FakeLog:
    """The server log port: keeps what was written, in memory."""

    def __init__(self, path: Any, max_bytes: int, backups: int, *, on_error: Any = None) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes | memoryview) -> None:
        self.data += data  # a copy: ``data`` may be the pump's shared buffer

    def close(self) -> None:
        self.closed = True


class FakeCleanup:
    def __init__(self) -> None:
        self.listening: set[int] = set()  # pids the port's listeners belong to (empty: not visible)

    def instance_id(self, state_dir: str) -> str:
        return "component-instance"

    def find_stale(self, **kw: Any) -> StaleReport:
        return StaleReport()

    async def kill_stale(self, report: StaleReport, *, grace_s: float, kill_foreign: bool = False) -> list[int]:
        return []

    def listeners(self, port: int) -> set[int]:
        return set(self.listening)


class FakePreflight:
    async def run_preflight(self, cfg: Config, probe: Any, *, degraded_ok: bool = False) -> list[Any]:
        return []


class FakeControl:
    async def close(self) -> None: ...


async def start_control(state_dir: str, handler: Any) -> FakeControl:
    return FakeControl()


def no_gpu_monitor(*args: Any, **kw: Any) -> Any:
    raise AssertionError("gpu backend 'none' builds no monitor")


class Rig:
    """A Daemon on fake ports, run as a task."""

    def __init__(self, tmp_path: Path, router: Any = None, **policy: Any) -> None:
        self.cfg = Config(
            server=ServerConfig(model_path="/models/m", stop_grace_s=1.0),
            health=HealthConfig(startup_poll_s=0.01, interval_s=0.05, timeout_s=1.0),
            policy=PolicyConfig(**{"backoff_initial_s": 0.01, "backoff_max_s": 0.02, **policy}),
            logging=LoggingConfig(memory_events="off"),
            state=StateConfig(dir=str(tmp_path)),
            router=RouterConfig(enabled=router is not None, url="http://127.0.0.1:30080", reconcile_s=0.05),
            name="component",
        )
        self.sink = Recorder()
        self.logger = Logger()
        self.store = FakeStore(tmp_path)
        self.spawner = FakeSpawner()
        self.prober = FakeProber()
        self.cleanup = FakeCleanup()
        ports = fake_ports(
            self.store, sinks=[self.sink], logger=self.logger, start_control=start_control, cleanup=self.cleanup,
            preflight=FakePreflight(), spawner=self.spawner, prober=lambda url, timeout_s: self.prober,
            gpu_monitor=no_gpu_monitor, open_log=FakeLog, oom_kills=lambda path: None, environ={}, router=router,
        )
        self.daemon = Daemon(self.cfg, ports)
        self.task: asyncio.Task[int] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.daemon.run())

    async def until(self, predicate: Callable[[], Any], what: str) -> None:
        """Yield to the loop until ``predicate()`` holds (the test's deadline bounds it)."""
        while not predicate():
            if self.task is not None and self.task.done():
                raise AssertionError(f"the daemon ended (exit {self.task.result()}) before: {what}")
            await self.sink.emitted()

    def state(self) -> State | None:
        core = self.daemon.units[0].core
        return core.state if core else None

    async def stop(self) -> int:
        self.daemon.request_stop("test")
        assert self.task is not None
        return await self.task


# -- tests ---------------------------------------------------------------------------------


async def test_a_probe_in_flight_when_the_server_exits_is_cancelled_and_never_speaks_for_the_next(tmp_path):
    """A probe still waiting when its server exits is cancelled: its late 200 does not make
    the next server READY, and a cancelled probe is no failure of the daemon."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)
        late = asyncio.Event()
        rig.prober.answers = [late]  # the first probe hangs; every later one is refused
        rig.start()
        await rig.until(lambda: rig.prober.calls >= 1, "the first probe")
        first = rig.spawner.servers[0]
        first.exit(1)
        await rig.until(lambda: len(rig.spawner.servers) == 2, "the relaunch")
        assert rig.prober.cancelled == 1
        late.set()  # the old server's 200 would come in now, too late
        await rig.until(lambda: rig.prober.calls >= 3, "probes of the second server")
        assert rig.state() is State.STARTING
        assert not rig.sink.find("server_ready")
        assert all(not p["ok"] for p in rig.sink.find("probe"))
        assert await rig.stop() == 0
        assert not rig.sink.find("daemon_failed")
        assert rig.spawner.servers[1].stopped_with == [signal.SIGTERM]


async def test_each_launch_begins_with_the_marker_explain_reads(tmp_path):
    """The daemon writes ``launch_marker`` before each launch, and ``explain``'s splitter reads
    it back: the attempt, an RFC 3339 wall time and the argv (the two cannot drift)."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)
        rig.start()
        await rig.until(lambda: rig.prober.calls >= 1, "the first probe")
        rig.spawner.servers[0].exit(1)
        await rig.until(lambda: len(rig.spawner.servers) == 2, "the relaunch")
        assert await rig.stop() == 0
    text = b"".join(bytes(log.data) for log in rig.spawner.logs).decode()
    launches = split_launches(text)
    assert [launch.marker.attempt for launch in launches if launch.marker] == [1, 2]
    for launch in launches:
        assert launch.marker is not None
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", launch.marker.wall)
        assert "--model-path /models/m" in launch.marker.argv


async def test_a_stop_while_the_launch_is_in_flight_waits_for_it_and_stops_that_server(tmp_path):
    """A stop that comes while the server is being spawned waits for the launch, then drains
    the server it produced: none is left running and the daemon exits 0."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)
        rig.spawner.gate = asyncio.Event()
        rig.start()
        await rig.until(rig.spawner.spawning.is_set, "the launch")
        rig.daemon.request_stop("test")
        await rig.until(lambda: rig.state() is State.STOPPING, "STOPPING")
        rig.spawner.gate.set()
        assert rig.task is not None
        assert await rig.task == 0
        [server] = rig.spawner.servers
        assert server.stopped_with == [signal.SIGTERM]
        assert server.returncode is not None and server.closed
        assert rig.sink.find("server_stopped")
        assert rig.state() is State.STOPPED


async def test_state_store_failures_are_reported_once_per_episode(tmp_path):
    """A failing state store gives one ``state_write_failed`` however many writes fail, one
    ``state_write_recovered`` log line when a write works again, and a new report if it fails again."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)
        rig.store.failing = True
        rig.start()
        await rig.until(lambda: (core := rig.daemon.units[0].core) is not None and core.pid is not None, "Launched")
        assert rig.store.attempts >= 2
        assert len(rig.sink.find("state_write_failed")) == 1
        assert not rig.logger.find("state_write_recovered")

        rig.store.failing = False
        rig.prober.default = True
        await rig.until(lambda: rig.state() is State.READY, "READY")
        await rig.until(lambda: rig.logger.find("state_write_recovered"), "the recovery")
        assert len(rig.logger.find("state_write_recovered")) == 1
        assert rig.store.saves

        rig.store.failing = True
        assert await rig.stop() == 0
        assert len(rig.sink.find("state_write_failed")) == 2
        assert len(rig.logger.find("state_write_recovered")) == 1


async def test_a_failing_watcher_ends_the_daemon_loudly_and_stops_the_server(tmp_path):
    """The task that watches the server dies while the server serves: the daemon says
    ``daemon_failed``, drains and stops the server, and exits non-zero (systemd restarts it)
    instead of waiting in READY for an exit nobody will report."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)
        rig.prober.default = True
        rig.start()
        await rig.until(lambda: rig.state() is State.READY, "READY")
        [server] = rig.spawner.servers
        server.break_wait(RuntimeError("watcher broke"))
        assert rig.task is not None
        code = await rig.task
        assert code == EXIT_DAEMON_FAILED != 0
        [failed] = rig.sink.find("daemon_failed")
        assert failed["task"] == "watch"
        assert "watcher broke" in failed["error"]
        assert server.stopped_with == [signal.SIGTERM]  # drained first, as on a normal stop
        assert server.returncode is not None
        assert rig.store.released
        [stopping] = rig.sink.find("daemon_stopping")
        assert "watch" in stopping["reason"]
        names = [e for e, _f in rig.sink.events]
        assert names.index("daemon_failed") < names.index("daemon_stopping")


@pytest.mark.parametrize("where", ["prepare", "probe"])
async def test_any_failing_background_task_ends_the_daemon(tmp_path, where):
    """Not only the watcher: a probe task that raises is as fatal (the next poll is set only
    when a probe answers); ``_prepare`` keeps its own guard and reports a failed prepare."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)

        async def broken(*args: Any, **kw: Any) -> Any:
            raise RuntimeError(f"{where} broke")

        if where == "probe":
            rig.prober.probe = broken  # type: ignore[method-assign]
            rig.start()
            assert rig.task is not None
            assert await rig.task == EXIT_DAEMON_FAILED
            assert rig.sink.find("daemon_failed")[0]["task"] == "probe"
            assert rig.spawner.servers[0].stopped_with == [signal.SIGTERM]
        else:
            rig.daemon.units[0].p.preflight.run_preflight = broken  # type: ignore[method-assign]
            rig.start()
            await rig.until(lambda: rig.sink.find("preflight_retry"), "the retry after the guarded error")
            assert not rig.sink.find("daemon_failed")
            assert await rig.stop() == 0


async def test_ready_only_when_the_listener_on_the_port_is_in_our_tree(tmp_path):
    """A 200 from a port held by a process that is not ours (a server that failed to bind sees
    its warm-up answered by the other one) is not readiness; our own listener is."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)
        rig.prober.default = True
        rig.cleanup.listening = {424242}  # someone else's
        rig.start()
        await rig.until(lambda: rig.prober.calls >= 3, "probes answered by the foreign listener")
        assert rig.state() is State.STARTING
        refused = [p for p in rig.sink.find("probe") if not p["ok"]]
        assert refused and "not our server" in refused[0]["error"]
        rig.cleanup.listening = {424242, rig.spawner.servers[0].pid}
        await rig.until(lambda: rig.state() is State.READY, "READY on our own listener")
        assert await rig.stop() == 0


async def test_a_dead_part_is_the_crash_and_sglangs_own_teardown_is_awaited(tmp_path):
    """A scheduler's death (its pidfd) leaves READY at once with a server_down event; the daemon
    sends nothing to the main process (it is tearing itself down) and diagnoses after its exit."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)
        rig.prober.default = True
        rig.start()
        await rig.until(lambda: rig.state() is State.READY, "READY")
        first = rig.spawner.servers[0]
        assert first.on_part_died is not None
        first.on_part_died(4343, "sglang::scheduler")
        await rig.until(lambda: rig.sink.find("server_down"), "server_down")
        assert [c["to"] for c in rig.sink.find("state_changed")][2:4] == ["READY", "EXITED"]
        [down] = rig.sink.find("server_down")
        assert (down["pid"], down["title"]) == (4343, "sglang::scheduler")
        await rig.until(lambda: first.stopped_with, "the bounded teardown")
        assert first.stopped_with == [None]  # await SGLang's own teardown; no signal of ours first
        await rig.until(lambda: rig.sink.find("crash"), "the diagnosis")
        assert rig.sink.find("crash")[0]["part_died"] == "sglang::scheduler (pid 4343)"
        await rig.until(lambda: len(rig.spawner.servers) == 2, "the relaunch")
        assert await rig.stop() == 0


async def test_the_collector_is_held_from_a_death_until_its_crash_is_told(tmp_path):
    """No full collection in a crash's path (unit.gchold): the cyclic GC is off from the
    death to the ``crash`` event, and on again once it is told."""
    gc.enable()
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path)
        rig.prober.default = True
        seen: list[tuple[str, bool]] = []
        rig.sink.emit = _also(rig.sink.emit, lambda e: seen.append((e.kind, gc.isenabled())))
        rig.start()
        await rig.until(lambda: rig.state() is State.READY, "READY")
        first = rig.spawner.servers[0]
        assert first.on_part_died is not None
        first.on_part_died(4343, "sglang::scheduler")
        await rig.until(lambda: len(rig.spawner.servers) == 2, "the relaunch")
        told = dict(seen)
        assert told["server_down"] is False and told["crash"] is False
        assert gc.isenabled(), "the collector is on again once the crash is told"
        assert await rig.stop() == 0
    assert gc.isenabled()


def _also(emit: Callable[[Event], None], see: Callable[[Event], None]) -> Callable[[Event], None]:
    def both(event: Event) -> None:
        see(event)
        emit(event)

    return both


async def test_a_restart_request_drains_and_relaunches_at_once(tmp_path):
    """The control socket's restart: SIGTERM to the main process (a drain), an immediate
    relaunch, not counted as a crash."""
    async with asyncio.timeout(DEADLINE_S):
        rig = Rig(tmp_path, backoff_initial_s=60.0, backoff_max_s=60.0)
        rig.prober.default = True
        rig.start()
        await rig.until(lambda: rig.state() is State.READY, "READY")
        answer = rig.daemon._on_control({"cmd": "restart"})
        assert answer["ok"] and answer["state"] == "READY"
        await rig.until(lambda: len(rig.spawner.servers) == 2, "the relaunch (no 60 s backoff)")
        assert rig.spawner.servers[0].stopped_with == [signal.SIGTERM]
        assert not rig.sink.find("crash")
        assert rig.daemon._on_control({"cmd": "reboot"}) == {"ok": False, "error": "unknown command 'reboot'"}
        assert await rig.stop() == 0


# -- issue 15: the router ------------------------------------------------------------------


class OrderedRouter:
    """A router whose calls land in the shared ``timeline`` (removal takes a while)."""

    def __init__(self, timeline: list[str]) -> None:
        self.timeline = timeline
        self.workers: dict[str, str] = {}
        self.n = 0

    async def list_workers(self) -> list[Any]:
        from supervisor.adapters.ports import RouterWorker

        return [RouterWorker(id=i, url=u, healthy=True) for i, u in self.workers.items()]

    async def add(self, worker_url: str) -> str:
        self.n += 1
        self.workers[f"w{self.n}"] = worker_url
        self.timeline.append("add")
        return f"w{self.n}"

    async def remove(self, worker_id: str) -> None:
        await asyncio.sleep(0.05)
        if self.workers.pop(worker_id, None) is not None:
            self.timeline.append("remove")

    async def aclose(self) -> None: ...


async def test_the_router_sends_nothing_to_a_server_being_stopped_or_dead(tmp_path):
    """READY: registered. A planned restart: out of the router before the SIGTERM that
    drains it. A dead scheduler: out at once, before SGLang's teardown ends the server."""
    async with asyncio.timeout(DEADLINE_S):
        timeline: list[str] = []
        router = OrderedRouter(timeline)
        rig = Rig(tmp_path, router=router, backoff_initial_s=0.01)
        rig.prober.default = True
        rig.start()
        await rig.until(lambda: "add" in timeline, "registered once READY")
        assert list(router.workers.values()) == ["http://127.0.0.1:30000"]
        def record_stops(server: FakeServer) -> None:
            original_stop = server.stop

            async def stop(grace_s: float, first_signal: Any = signal.SIGTERM) -> Any:
                timeline.append(f"stop {first_signal!r}")
                return await original_stop(grace_s, first_signal)

            server.stop = stop  # type: ignore[method-assign]

        record_stops(rig.spawner.servers[0])
        rig.daemon._on_control({"cmd": "restart"})
        await rig.until(lambda: len(rig.spawner.servers) == 2, "the relaunch")
        assert timeline[:3] == ["add", "remove", f"stop {signal.SIGTERM!r}"], timeline
        await rig.until(lambda: timeline.count("add") == 2, "registered again once READY")
        second = rig.spawner.servers[1]
        record_stops(second)
        second.on_part_died(4343, "sglang::scheduler")  # type: ignore[misc]
        await rig.until(lambda: "stop None" in timeline, "SGLang's teardown awaited")
        assert timeline[-2:] == ["remove", "stop None"], timeline  # out before the teardown is awaited
        [removed] = [r for r in rig.sink.find("router_removed") if r["reason"].startswith("sglang::scheduler")]
        assert removed["after_s"] < 1.0
        assert rig.store.saves[-1]["router_worker_id"] is None
        assert await rig.stop() == 0
