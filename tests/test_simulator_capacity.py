"""The simulator's capacity signals: the GPU's activation peak.

The tests drive one scheduler's pure pieces in this process (no timing).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.sim import simgpu, simulator
from supervisor.sim.simulator import MIB, Rank, RankMemory, Scheduler, SimConfig, boundary_fraction, parse_args

GIB = simgpu.GIB
SEED_GRAPH_GB = 96 * (1 - simulator.SEED_FRACTION) - simulator.SEED_HEADROOM_GB  # 5.9 GiB


def config(*flags: str) -> SimConfig:
    return SimConfig.from_args(parse_args(["--model-path", "/models/DeepSeek-V3", *flags]))


def memory(fraction: float, *, total: float = 96.0, free: float | None = None, graph: float = SEED_GRAPH_GB,
           max_tokens: int | None = None, version: str = "0.5.23") -> RankMemory:
    return RankMemory(total, total if free is None else free, 72.33, fraction, graph, simulator.KV_BYTES_PER_TOKEN,
                      max_tokens, slack_from_free=version != "0.5.6")


class Harness:
    """One scheduler in this process; what it sends comes back through a socket pair."""

    def __init__(self, cfg: SimConfig, mem: RankMemory) -> None:
        self.ours, theirs = socket.socketpair()
        self.ours.setblocking(False)
        self.sched = Scheduler(cfg, Rank(0, 0, 1, 0, 1, v56=cfg.version == "0.5.6"), theirs, parent_pid=0)
        self.sched.mem = mem
        self.buf = b""
        self.msgs: list[dict[str, Any]] = []
        self.rids = 0

    def read(self) -> list[dict[str, Any]]:
        while True:
            try:
                chunk = self.ours.recv(1 << 16)
            except BlockingIOError:
                break
            *lines, self.buf = (self.buf + chunk).split(b"\n")
            self.msgs += [json.loads(line) for line in lines]
        return self.msgs

    def submit(self, n: int, tokens: int, max_new: int) -> None:
        for _ in range(n):
            self.rids += 1
            self.sched.handle({"op": "req", "rid": self.rids, "tokens": tokens, "max_new": max_new})

    def done(self) -> list[dict[str, Any]]:
        return [m for m in self.read() if m["op"] == "done"]

    def run(self, max_steps: int = 100_000) -> None:
        """Prefill when something waits, decode when something runs, until all is done; the
        KV pool never holds more than it has."""
        s = self.sched
        assert s.mem is not None
        for _ in range(max_steps):
            if not (s.waiting or s.running):
                return
            if s.waiting:
                s.prefill()
            if s.running:
                s.decode()
            assert s.used_tokens() <= s.mem.kv_tokens
            self.read()
        raise AssertionError("the scheduler never drained")

    def close(self) -> None:
        self.ours.close()
        self.sched.sock.close()


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(cfg: SimConfig, mem: RankMemory) -> Harness:
        made.append(Harness(cfg, mem))
        return made[-1]

    yield make
    for h in made:
        h.close()


# --------------------------------------------------------------------------- 1. the GPU's peak


@pytest.mark.parametrize(("total", "free", "graph", "act_mb", "burst", "version"), [
    (96.0, None, SEED_GRAPH_GB, 0.25, 4000, "0.5.23"),  # the seed profile: boundary 0.9284
    (96.0, None, SEED_GRAPH_GB, 0.25, 8192, "0.5.23"),
    (140.0, None, 4.0, 0.5, 2048, "0.5.23"),
    (96.0, 90.0, SEED_GRAPH_GB, 0.25, 2000, "0.5.23"),  # someone else holds 6 GiB of the card
    (96.0, None, SEED_GRAPH_GB, 0.25, 4000, "0.5.6"),
])
def test_boundary_fraction_splits_fits_from_oom(total: float, free: float | None, graph: float, act_mb: float,
                                                burst: int, version: str) -> None:
    """Just below the helper's boundary a burst's activations fit the headroom; just above, they OOM."""
    boundary = boundary_fraction(total, graph, act_mb * MIB, burst, free_gb=free, version=version)
    for fraction, fits in ((boundary - 1e-4, True), (boundary - 1e-6, True), (boundary + 1e-5, False),
                           (boundary + 1e-3, False)):
        mem = memory(fraction, total=total, free=free, graph=graph, version=version)
        assert mem.kv_tokens > 0
        assert mem.activation_fits(burst * act_mb * MIB) is fits, (fraction, mem.headroom_gb)


def test_the_seed_boundary_sits_between_0_928_and_0_93() -> None:
    """The existing 4000-token OOM test at 0.93 is this boundary's upper side."""
    assert 0.928 < boundary_fraction(96.0, SEED_GRAPH_GB, 0.25 * MIB, 4000) < 0.93


def test_a_new_activation_peak_is_written_once_and_shows_as_used_gpu_memory(
        harness: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_dir = tmp_path / "gpus"
    simgpu.ensure_gpus(gpu_dir, 1, 96.0)
    cfg = config("--sim-gpu-dir", str(gpu_dir), "--mem-fraction-static", "0.9")
    h = harness(cfg, memory(0.9))
    mem = h.sched.mem
    assert mem is not None
    writes: list[int] = []
    real_write = simgpu.write_process

    def counting(directory: Any, pid: int, allocations: dict[int, int], **kw: Any) -> None:
        writes.append(allocations[0])
        real_write(directory, pid, allocations, **kw)

    monkeypatch.setattr(simgpu, "write_process", counting)

    def free() -> int:
        return simgpu.read_gpus(gpu_dir)[0].free_bytes

    h.sched.write_gpu(mem.held_gb)  # what init leaves: the static footprint
    static = int(mem.held_gb * GIB)
    assert free() == 96 * GIB - static
    for tokens in (1000, 500, 1000, 3000, 2000, 3000):
        h.sched.note_activation(tokens * cfg.act_bytes_per_token)
    assert writes == [static, int(mem.held_gb * GIB + 1000 * 0.25 * MIB), int(mem.held_gb * GIB + 3000 * 0.25 * MIB)]
    assert free() == 96 * GIB - static - 3000 * 0.25 * MIB
    assert h.sched.facts()["held_bytes"] == 96 * GIB - free()


def test_an_activation_over_the_headroom_is_the_runtime_oom_and_no_peak(
        harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness(config("--mem-fraction-static", "0.9"), memory(0.9))
    mem = h.sched.mem
    assert mem is not None
    tried: list[float] = []

    def oom(activation: float) -> None:
        tried.append(activation)
        raise RuntimeError("oom")

    monkeypatch.setattr(h.sched, "runtime_oom", oom)
    over = mem.headroom_gb * GIB + 1
    with pytest.raises(RuntimeError):
        h.sched.note_activation(over)
    assert tried == [over] and h.sched.peak_act_bytes == 0
    h.sched.note_activation(mem.headroom_gb * GIB)  # exactly the headroom still fits
    assert h.sched.peak_act_bytes == mem.headroom_gb * GIB
