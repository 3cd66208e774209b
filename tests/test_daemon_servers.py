"""One daemon, two servers, through fake ports: each server runs its own state machine, a
crash of one never touches the other, and a restart takes them down one at a time, each
only while the other serves (the fakes are tests/test_daemon_component.py's)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fakeports import fake_ports
from test_daemon_component import (
    DEADLINE_S,
    FakeCleanup,
    FakeLog,
    FakePreflight,
    FakeProber,
    FakeServer,
    FakeSpawner,
    FakeStore,
    Logger,
    Recorder,
    start_control,
)

from supervisor.adapters.ports import ControlReply, NoneProbe
from supervisor.core.config import (
    Config,
    GpuConfig,
    HealthConfig,
    LoggingConfig,
    PolicyConfig,
    ServerConfig,
    StateConfig,
)
from supervisor.core.model import State
from supervisor.daemon import Daemon


class BoundLogger(Logger):
    """The fake logger with structlog's ``bind`` (each server's log lines carry its name)."""

    def bind(self, **fields: Any) -> Logger:
        return self


class Spawner(FakeSpawner):
    """Keeps which server (by its --port) each FakeServer was launched for."""

    def __init__(self) -> None:
        super().__init__()
        self.by_port: dict[int, list[FakeServer]] = {}
        self.envs: dict[int, dict[str, str]] = {}

    async def spawn(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None, log: Any,
                    tail_bytes: int) -> FakeServer:
        server = await super().spawn(argv, env=env, cwd=cwd, log=log, tail_bytes=tail_bytes)
        self.by_port.setdefault(int(argv[list(argv).index("--port") + 1]), []).append(server)
        self.envs[server.pid] = dict(env)
        return server


class Pair:
    """A Daemon owning servers "a" (port 31001, GPU 0) and "b" (port 31002, GPU 1)."""

    PORTS = {"a": 31001, "b": 31002}

    def __init__(self, tmp_path: Path) -> None:
        base = Config(
            health=HealthConfig(startup_poll_s=0.01, interval_s=0.05, timeout_s=1.0),
            policy=PolicyConfig(backoff_initial_s=0.01, backoff_max_s=0.02),
            logging=LoggingConfig(memory_events="off"),
            state=StateConfig(dir=str(tmp_path)),
            name="pair",
        )
        units = tuple(
            replace(base, server=ServerConfig(name=name, model_path="/models/m", port=port, stop_grace_s=1.0),
                    state=StateConfig(dir=str(tmp_path / name)), gpu=GpuConfig(indices=(i,)))
            for i, (name, port) in enumerate(self.PORTS.items())
        )
        self.cfg = replace(base, units=units)
        self.daemon_sink = Recorder()
        self.sinks = {name: Recorder() for name in self.PORTS}
        self.spawner = Spawner()
        self.probers = {name: FakeProber(default=True) for name in self.PORTS}
        ports = fake_ports(
            FakeStore(tmp_path), sinks=[self.daemon_sink], logger=BoundLogger(), start_control=start_control,
            unit_store=lambda cfg: FakeStore(Path(cfg.state.dir)),
            unit_sinks={name: [sink] for name, sink in self.sinks.items()},
            cleanup=FakeCleanup(), preflight=FakePreflight(), spawner=self.spawner, prober=self._prober,
            gpu_monitor=lambda *a, **k: None, open_log=FakeLog, oom_kills=lambda path: None, environ={},
            gpu_probe=NoneProbe(),
        )
        self.daemon = Daemon(self.cfg, ports)
        self.task: asyncio.Task[int] | None = None

    def _prober(self, url: str, timeout_s: float) -> FakeProber:
        return next(self.probers[n] for n, p in self.PORTS.items() if f":{p}/" in url)

    def state(self, name: str) -> State | None:
        core = self.daemon.unit(name).core
        return core.state if core else None

    def servers(self, name: str) -> list[FakeServer]:
        return self.spawner.by_port.get(self.PORTS[name], [])

    async def until(self, predicate: Callable[[], Any], what: str) -> None:
        while not predicate():
            if self.task is not None and self.task.done():
                raise AssertionError(f"the daemon ended (exit {self.task.result()}) before: {what}")
            await self.daemon_sink.emitted()

    async def both_ready(self) -> None:
        await self.until(lambda: self.state("a") is State.READY and self.state("b") is State.READY, "both READY")


async def test_a_crash_of_one_server_never_touches_the_other(tmp_path: Path) -> None:
    async with asyncio.timeout(DEADLINE_S):
        pair = Pair(tmp_path)
        pair.task = asyncio.create_task(pair.daemon.run())
        await pair.both_ready()
        b_server = pair.servers("b")[0]
        b_states: list[State | None] = []
        pair.servers("a")[0].exit(1)  # a dies
        while len(pair.servers("a")) < 2 or pair.state("a") is not State.READY:
            b_states.append(pair.state("b"))
            await pair.daemon_sink.emitted()
        assert set(b_states) == {State.READY}  # b never left READY
        assert pair.servers("b") == [b_server] and b_server.stopped_with == [] and b_server.returncode is None
        # each server's events reach its own sinks, named; b's saw no crash
        assert [e["server"] for e in pair.sinks["a"].find("crash")] == ["a"]
        assert pair.sinks["b"].find("crash") == []
        # each gets its own GPUs as CUDA sees them
        envs = pair.spawner.envs
        assert envs[pair.servers("a")[1].pid]["CUDA_VISIBLE_DEVICES"] == "0"
        assert envs[b_server.pid]["CUDA_VISIBLE_DEVICES"] == "1"
        pair.daemon.request_stop("test")
        assert await pair.task == 0
        assert b_server.stopped_with and pair.servers("a")[1].stopped_with  # both stopped at the end


async def test_a_restart_takes_the_servers_down_one_at_a_time_and_refuses_a_second_pass(tmp_path: Path) -> None:
    async with asyncio.timeout(DEADLINE_S):
        pair = Pair(tmp_path)
        pair.task = asyncio.create_task(pair.daemon.run())
        await pair.both_ready()
        answer = pair.daemon._on_control({"cmd": "restart"})
        assert answer["ok"] and [s["name"] for s in answer["servers"]] == ["a", "b"]
        assert pair.daemon._on_control({"cmd": "restart"}) == {"ok": False, "error": "a rolling restart is already in progress"}
        never_both_down = True
        while not (len(pair.servers("a")) == 2 and len(pair.servers("b")) == 2 and pair.state("b") is State.READY):
            if pair.state("a") is not State.READY and pair.state("b") is not State.READY:
                never_both_down = False
            await pair.daemon_sink.emitted()
        assert never_both_down
        # a was back (relaunched) before b was stopped
        a_new, b_old = pair.servers("a")[1], pair.servers("b")[0]
        assert a_new.pid < pair.servers("b")[1].pid and b_old.stopped_with
        await pair.until(lambda: pair.daemon_sink.find("rolling_restart")[-1:] and
                         pair.daemon_sink.find("rolling_restart")[-1]["step"] == "done", "the pass done")
        steps = [(e["step"], e.get("server")) for e in pair.daemon_sink.find("rolling_restart")]
        assert steps == [("restart", "a"), ("restart", "b"), ("done", None)]
        pair.daemon.request_stop("test")
        assert await pair.task == 0


async def test_restart_of_one_server_by_name_restarts_only_that_one(tmp_path: Path) -> None:
    async with asyncio.timeout(DEADLINE_S):
        pair = Pair(tmp_path)
        pair.task = asyncio.create_task(pair.daemon.run())
        await pair.both_ready()
        assert pair.daemon._on_control({"cmd": "restart", "server": "c"}) == {
            "ok": False, "error": "no server 'c' (known: a, b)"}
        assert pair.daemon._on_control({"cmd": "restart", "server": "b"})["ok"]
        await pair.until(lambda: len(pair.servers("b")) == 2 and pair.state("b") is State.READY, "b restarted")
        assert len(pair.servers("a")) == 1 and pair.servers("a")[0].stopped_with == []
        pair.daemon.request_stop("test")
        assert await pair.task == 0


async def test_a_pass_waits_for_another_server_to_serve_before_it_takes_one_down(tmp_path: Path) -> None:
    async with asyncio.timeout(DEADLINE_S):
        pair = Pair(tmp_path)
        pair.probers["b"].default = False  # b starts but does not answer yet
        pair.task = asyncio.create_task(pair.daemon.run())
        await pair.until(lambda: pair.state("a") is State.READY and pair.state("b") is State.STARTING, "a READY, b up")
        assert pair.daemon._on_control({"cmd": "restart"})["ok"]
        await pair.until(lambda: pair.daemon_sink.find("rolling_restart"), "the pass begins")
        assert pair.daemon_sink.find("rolling_restart")[0]["step"] == "waiting"
        await asyncio.sleep(0.3)
        assert len(pair.servers("a")) == 1 and pair.state("a") is State.READY  # a kept serving
        pair.probers["b"].default = True  # b serves: now a may go down
        await pair.until(lambda: len(pair.servers("a")) == 2, "a restarted once b served")
        pair.daemon.request_stop("test")
        assert await pair.task == 0


def test_a_group_node_refuses_a_restart_of_its_own(tmp_path: Path) -> None:
    """A node of a multi-node group cannot restart alone: the group relaunches as one."""
    from supervisor.core.config import build_config

    cfg = build_config({"server": {"model_path": "/m", "tp_size": 2},
                        "group": {"name": "kimi", "node_rank": 1, "nnodes": 2, "dist_init_addr": "10.0.0.1:5000"},
                        "etcd": {"endpoints": ["127.0.0.1:2379"]}, "state": {"dir": str(tmp_path)}})
    ports = fake_ports(
        FakeStore(tmp_path), sinks=[], logger=BoundLogger(), start_control=start_control, cleanup=FakeCleanup(),
        preflight=FakePreflight(), spawner=Spawner(), prober=lambda url, timeout_s: FakeProber(),
        gpu_monitor=lambda *a, **k: None, open_log=FakeLog, oom_kills=lambda path: None,
    )
    answer = Daemon(cfg, ports)._on_control({"cmd": "restart"})
    assert answer == {"ok": False, "error": "node 1 of group 'kimi' cannot restart alone: the group relaunches as one "
                                            "(docs/group.md)"}


async def test_a_restart_that_waits_hears_each_step_and_its_last_line_comes_when_the_pass_is_done(tmp_path: Path) -> None:
    """``sglang-supervisor restart`` returns on the daemon's last line: by then every server
    of the pass is READY again at a later launch (and in the router), never before."""
    async with asyncio.timeout(DEADLINE_S):
        pair = Pair(tmp_path)
        pair.task = asyncio.create_task(pair.daemon.run())
        await pair.both_ready()
        reply = pair.daemon._on_control({"cmd": "restart", "wait": True})
        assert isinstance(reply, ControlReply) and reply.answer["ok"]
        lines = [line async for line in reply.then]
        reply.close()
        *steps, last = lines
        assert last["done"] and last["ok"], last
        assert [(s["name"], s["state"], s["attempt"]) for s in last["servers"]] == [("a", "READY", 2), ("b", "READY", 2)]
        assert pair.state("a") is State.READY and pair.state("b") is State.READY
        assert pair.daemon_sink.find("rolling_restart")[-1]["step"] == "done"
        states = [(line["server"], line["state"]) for line in steps if "state" in line]
        assert states.index(("a", "READY")) < states.index(("b", "RESTARTING")), states  # one at a time
        assert pair.daemon._followers == set()
        pair.daemon.request_stop("test")
        assert await pair.task == 0
