"""The simulator's capacity signals: the GPU's activation peak, KV-pool retraction, /metrics.

Most tests drive one scheduler's pure pieces in this process (no timing); the last ones run
a short simulated server, like tests/test_simulator.py.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from test_simulator import Sim, call, sim  # noqa: F401 - sim is a fixture

from supervisor.sim import simgpu, simulator
from supervisor.sim.simulator import MIB, Rank, RankMemory, Scheduler, SimConfig, boundary_fraction, parse_args

GIB = simgpu.GIB
RETRACT_LINE = re.compile(
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] KV cache pool is full\. Retract requests\. "
    r"#retracted_reqs: (\d+), #new_tokens_gained: (\d+), #new_token_ratio: (\d\.\d{4}) -> (\d\.\d{4})$")
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


# --------------------------------------------------------------------------- 2. retraction


def retractions(text: str) -> list[re.Match[str]]:
    return [m for line in text.splitlines() if (m := RETRACT_LINE.match(line))]


def test_a_small_pool_under_long_requests_retracts_in_0_5_23_words(
        harness: Callable[..., Harness], capfd: pytest.CaptureFixture[str]) -> None:
    """12 requests of 10 + 500 tokens on a 3000-token pool: admission reserves only 0.7 of the
    running requests' remaining tokens, decode outgrows the pool and retracts; every request
    still completes with all its tokens, and the pool never overflows."""
    h = harness(config("--mem-fraction-static", "0.9"), memory(0.9, max_tokens=3000))
    h.submit(12, tokens=10, max_new=500)
    h.sched.prefill()
    assert len(h.sched.running) == 5 and len(h.sched.waiting) == 7  # 5 x 510 fit, the 6th waits
    h.run()
    found = retractions(capfd.readouterr().out)
    assert found
    for m in found:
        assert int(m[1]) >= 1 and int(m[2]) > 0
    assert found[0][3] != found[0][4]  # the ratio was re-estimated
    done = h.done()
    assert len(done) == 12 and all(d["completion_tokens"] == 500 and "abort" not in d for d in done)
    assert h.sched.retracted_total == sum(int(m[1]) for m in found)


def test_a_large_pool_under_the_same_load_never_retracts(
        harness: Callable[..., Harness], capfd: pytest.CaptureFixture[str]) -> None:
    h = harness(config("--mem-fraction-static", "0.9"), memory(0.9))
    h.submit(12, tokens=10, max_new=500)
    h.run()
    out = capfd.readouterr().out
    assert "Prefill batch, #new-seq: 12," in out
    assert not retractions(out) and "Retract" not in out
    assert len(h.done()) == 12 and h.sched.retracted_total == 0


def test_prefill_waits_while_the_pool_is_reserved(harness: Callable[..., Harness]) -> None:
    """Today's admission holds: with running requests, a new one waits until its prompt and
    max_new fit what the running ones leave (their remaining tokens x the new-token ratio)."""
    h = harness(config("--mem-fraction-static", "0.9"), memory(0.9, max_tokens=2000))
    h.submit(2, tokens=100, max_new=800)  # 900 each: both fit 2000
    h.sched.prefill()
    assert len(h.sched.running) == 2
    # 2000 - 2 x 101 used - 2 x 799 x 0.7 expected = 679.4 left, so a 100 + 700 request waits
    assert h.sched.rem_total_tokens() == pytest.approx(2000 - 202 - 2 * 799 * 0.7)
    h.submit(1, tokens=100, max_new=700)
    for _ in range(5):
        h.sched.prefill()
        h.sched.decode()
    assert len(h.sched.running) == 2 and len(h.sched.waiting) == 1
    h.submit(1, tokens=100, max_new=100)  # 200 would fit, but it queues behind the waiting one
    h.sched.prefill()
    assert len(h.sched.running) == 2 and len(h.sched.waiting) == 2
    h.run()
    assert len(h.done()) == 4


def test_retraction_order_and_ratio_follow_retract_decode(
        harness: Callable[..., Harness], capfd: pytest.CaptureFixture[str]) -> None:
    """The request with the fewest output tokens (then the longest prompt) goes first; the ratio
    becomes (decoded + 20 x kept) / (sum of kept max_new + 1)."""
    h = harness(config("--mem-fraction-static", "0.9"), memory(0.9, max_tokens=1000))
    s = h.sched
    reqs = [simulator.Req(rid, tokens, 400, 0.0, 0, generated) for rid, tokens, generated in
            ((1, 300, 100), (2, 100, 50), (3, 200, 50))]
    s.running = list(reqs)  # 400 + 150 + 250 = 800 of 1000 used
    capfd.readouterr()
    s.retract()
    (m,) = retractions(capfd.readouterr().out)
    assert m.groups() == ("1", "250", "0.7000", f"{(100 + 50 + 40) / (800 + 1):.4f}")
    assert [r.rid for r in s.running] == [1, 2] and [r.rid for r in s.waiting] == [3]
    assert s.waiting[0].prefill_left == 250  # prompt and output so far are prefilled again


def test_a_lone_request_the_pool_cannot_hold_is_aborted(
        harness: Callable[..., Harness], capfd: pytest.CaptureFixture[str]) -> None:
    h = harness(config("--mem-fraction-static", "0.9"), memory(0.9, max_tokens=300))
    h.submit(1, tokens=100, max_new=400)
    h.run()
    assert "due to OOM" in capfd.readouterr().out
    (done,) = h.done()
    assert done["abort"].startswith("Out of memory even after retracting") and done["completion_tokens"] == 200


# --------------------------------------------------------------------------- 3. /metrics


def test_metrics_reports_follow_the_scheduler(harness: Callable[..., Harness]) -> None:
    """Gauges at each batch report; the retraction gauge once, then 0; the counter at once."""
    h = harness(config("--enable-metrics", "--mem-fraction-static", "0.9"), memory(0.9, max_tokens=1000))
    s = h.sched
    s.running = [simulator.Req(1, 300, 400, 0.0, 0, 100), simulator.Req(2, 100, 400, 0.0, 0, 50)]
    s.retract()
    assert h.read()[-1] == {"op": "metrics", "retracted_total": 1}
    s.log_decode()
    s.log_decode()
    first, second = (m["gauges"] for m in h.read()[-2:])
    assert first == {"token_usage": 0.4, "num_running_reqs": 1, "num_queue_reqs": 1, "num_retracted_reqs": 1}
    assert second["num_retracted_reqs"] == 0


def test_no_metrics_reports_without_the_flag(harness: Callable[..., Harness]) -> None:
    h = harness(config("--mem-fraction-static", "0.9"), memory(0.9))
    h.submit(2, tokens=10, max_new=3)
    h.run()
    assert {m["op"] for m in h.read()} == {"done"}


def test_prometheus_text_is_prometheus_client_s() -> None:
    cfg = config("--served-model-name", 'my"model', "--dp-size", "2")
    text = simulator.prometheus_text(cfg, {
        0: {"token_usage": 0.25, "num_running_reqs": 3, "num_queue_reqs": 0, "num_retracted_reqs": 0, "retracted_total": 0},
        1: {"token_usage": 1.0, "num_running_reqs": 7, "num_queue_reqs": 2, "num_retracted_reqs": 2, "retracted_total": 5},
    })
    labels = 'engine_type="unified",model_name="my\\"model",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    assert text.splitlines()[:4] == [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        f'sglang:num_running_reqs{{dp_rank="0",{labels}}} 3.0',
        f'sglang:num_running_reqs{{dp_rank="1",{labels}}} 7.0',
    ]
    assert f'sglang:token_usage{{dp_rank="0",{labels}}} 0.25' in text
    assert "# TYPE sglang:num_retracted_reqs gauge" in text
    assert text.endswith("# HELP sglang:num_retracted_requests_total Total number of retracted requests.\n"
                         "# TYPE sglang:num_retracted_requests_total counter\n"
                         f'sglang:num_retracted_requests_total{{dp_rank="1",{labels}}} 5.0\n')
    assert simulator.prometheus_text(cfg, {}) == ""


# --------------------------------------------------------------------------- a short simulated run


def get_text(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert m, (name, text)
    return float(m[1])


@pytest.mark.integration
def test_a_served_night_shows_the_peak_retractions_and_metrics(sim: Callable[..., Sim]) -> None:  # noqa: F811
    s = sim("--sim-version", "0.5.23", "--enable-metrics", "--mem-fraction-static", "0.9",
            "--max-total-tokens", "3000")
    s.wait_ready()
    static = s.gpu_used(0)
    assert call(s.port, "/generate", {"text": " ".join(["w"] * 2000), "sampling_params": {"max_new_tokens": 1}}) == 200
    assert abs(s.gpu_used(0) - static - 2000 * 0.25 * MIB) <= 8 * 0.25 * MIB  # the warm-up's 6-token peak, replaced
    status, text = get_text(s.port, "/metrics")
    assert status == 200 and metric(text, "sglang:num_running_reqs") == 0

    threads = [threading.Thread(target=call, args=(s.port, "/generate", {
        "text": "a b c d e f g h i j", "sampling_params": {"max_new_tokens": 500}}), kwargs={"timeout": 120})
        for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    found = retractions(s.text)
    assert found
    wait_until(lambda: metric(get_text(s.port, "/metrics")[1], "sglang:num_running_reqs") == 0,
               what="the idle report")
    status, text = get_text(s.port, "/metrics")
    assert metric(text, "sglang:num_retracted_requests_total") == sum(int(m[1]) for m in found)
    assert metric(text, "sglang:num_queue_reqs") == 0
    assert 'model_name="/models/DeepSeek-V3"' in text


@pytest.mark.integration
def test_metrics_is_404_without_enable_metrics(sim: Callable[..., Sim]) -> None:  # noqa: F811
    s = sim("--sim-version", "0.5.23")
    s.wait_ready()
    assert get_text(s.port, "/metrics") == (404, '{"detail":"Not Found"}')
