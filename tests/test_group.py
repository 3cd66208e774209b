"""A multi-node group's pure decisions (``supervisor/core/group.py``): the root cause is the
node with the strongest finding, never the echo on its peers; ties go to etcd's order."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from diagnosis_corpus import MEMORY_CAUSES, REAL, entries

from supervisor.core.config import PolicyConfig, build_config
from supervisor.core.diagnosis import diagnose
from supervisor.core.group import (
    GROUP_STOP,
    Generation,
    Rank,
    Report,
    config_hash,
    diagnosis_from_dict,
    first_generation,
    next_generation,
    rank_of,
    root_cause,
)
from supervisor.core.machine import step
from supervisor.core.messages import (
    Boot,
    Ctx,
    Diagnosed,
    Emit,
    GroupEnded,
    GroupGaveUp,
    GroupLaunch,
    GroupReport,
    Launch,
    Launched,
    Persist,
    Prepare,
    Prepared,
    ProbeResult,
    RestartRequested,
    SetTimer,
    StopServer,
    TimerFired,
)
from supervisor.core.model import Cause, Diagnosis, ExitStatus, Phase, Remedy, State
from supervisor.core.state import Core, Learned, Timer

# What node 0 of a two-node group logged when node 1's scheduler was killed (real SGLang
# 0.5.23 on the CPU with gloo, tests/real/test_real_group.py; node 1 logs the same when node
# 0 dies).
NODE0_ECHO = """\
[2026-11-30 10:00:01 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/sglang/python/sglang/srt/managers/scheduler.py", line 2794, in run_scheduler_process
    scheduler.event_loop_normal()
  File "/sglang/python/sglang/srt/managers/scheduler.py", line 1012, in recv_requests
    recv_reqs = broadcast_pyobj(
  File "/sglang/python/sglang/srt/utils/common.py", line 1181, in broadcast_pyobj
    dist.broadcast(tensor_size, src=src, group=dist_group)
RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:13021. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF!

[2026-11-30 10:00:01] Received sigquit from a child process. It usually means the child failed.
"""
# What node 1 logged when node 0's process was killed: only its own SIGQUIT handler.
NODE1_ECHO = "[2026-11-30 10:00:02] Received sigquit from a child process. It usually means the child failed.\n"


def report(node: int, cause: Cause, revision: int, *evidence: str) -> Report:
    return Report(node, 3, Diagnosis(cause, Phase.SERVING, evidence=evidence), revision)


def test_a_hardware_or_memory_cause_on_any_node_wins_over_an_echo_on_another() -> None:
    echo = report(0, Cause.NCCL_ERROR, 10, "RuntimeError: gloo Read error: Connection reset by peer")
    oom = report(1, Cause.CUDA_OOM_RUNTIME, 12, "torch.OutOfMemoryError: CUDA out of memory")
    lost = report(2, Cause.GPU_HW_ERROR, 14, "NVML_ERROR_GPU_IS_LOST")
    local = report(3, Cause.CUDA_ERROR, 11, "CUDA error: an illegal memory access was encountered")
    assert root_cause([echo, oom]) is oom
    assert root_cause([echo, oom, lost]) is lost
    assert root_cause([echo, local]) is local
    assert root_cause([echo, local, oom]) is oom
    assert root_cause([]) is None


def test_among_equals_the_report_etcd_recorded_first_wins() -> None:
    first, second = report(1, Cause.CUDA_OOM_RUNTIME, 7), report(0, Cause.HOST_OOM, 9)
    assert root_cause([second, first]) is first  # by revision, whatever the list order
    a, b = report(0, Cause.NCCL_ERROR, 20), report(1, Cause.OTHER, 21, NODE1_ECHO.strip())
    assert root_cause([b, a]) is a  # two echoes: the first recorded


def test_the_peer_loss_logs_of_a_group_read_as_echoes() -> None:
    node0 = diagnose(NODE0_ECHO, exit_status=ExitStatus(code=137), phase=Phase.SERVING)
    node1 = diagnose(NODE1_ECHO, exit_status=ExitStatus(code=137), phase=Phase.SERVING)
    assert rank_of(node0) is Rank.ECHO, node0
    assert rank_of(node1) is Rank.ECHO, node1


def test_a_killed_scheduler_is_the_nodes_own_finding_and_outranks_the_peers_echo() -> None:
    """The real log of a SIGKILLed scheduler (tests/data/crashlogs/real) is a local finding."""
    killed = diagnose((REAL / "sigkill_scheduler.log").read_bytes(), exit_status=ExitStatus(code=137),
                      phase=Phase.SERVING)
    assert rank_of(killed) is Rank.LOCAL, killed
    echo = diagnose(NODE0_ECHO, exit_status=ExitStatus(code=137), phase=Phase.SERVING)
    chosen = root_cause([Report(0, 1, echo, 5), Report(1, 1, killed, 6)])
    assert chosen is not None and chosen.node_rank == 1


def test_a_real_memory_or_hardware_crash_is_never_taken_for_an_echo() -> None:
    """Real logs of OOMs and dead GPUs often end in "Received sigquit from a child process";
    where the diagnosis reads them right (the diagnosis tests count the rest), that line
    never makes them an echo."""
    checked = []
    for entry in entries():
        if entry.label in MEMORY_CAUSES | {"gpu_hw_error"}:
            diagnosis = entry.diagnose()
            if str(diagnosis.cause) == entry.label:
                assert rank_of(diagnosis) >= Rank.MEMORY, (entry.name, diagnosis)
                checked.append(entry.name)
    assert len(checked) >= 30, checked


def test_a_report_and_a_generation_survive_their_json_form() -> None:
    d = Diagnosis(Cause.CUDA_OOM_STARTUP, Phase.STARTING, evidence=("CUDA out of memory",),
                  location="model_runner.py:300 load_model", remedy_override=Remedy.CLEAR_GPU, min_fraction=None)
    back = diagnosis_from_dict(d.to_dict())
    assert (back.cause, back.phase, back.evidence, back.location, back.remedy) == (
        d.cause, d.phase, d.evidence, d.location, Remedy.CLEAR_GPU)
    assert diagnosis_from_dict({"cause": "no such cause"}).cause is Cause.OTHER
    gen = Generation(number=4, fraction=0.88, hicache_size_gb=48, config_hash="abc", leader="node-1",
                     reason="a CUDA OOM while serving: mem_fraction_static 0.93 -> 0.88", delay_s=10.0,
                     root_cause={"node_rank": 1, "cause": "cuda_oom_runtime"}, oom_fractions=(0.93,), failures=2,
                     stable=True)
    assert Generation.from_json(gen.to_json()) == gen
    with pytest.raises(ValueError):
        Generation.from_json(b"[1, 2]")


def test_nodes_agree_on_the_group_relevant_config_only() -> None:
    base = {"model_path": "/m", "tp_size": 16, "dp_size": 1, "hicache_size_gb": 0, "mem_fraction_static": 0.9,
            "port": 30000}
    h = config_hash(base, ["--kv-cache-dtype=fp8"], (0.93, 0.88), 2, "10.0.0.1:5000")
    assert h == config_hash({**base, "port": 31000}, ["--kv-cache-dtype=fp8"], (0.93, 0.88), 2, "10.0.0.1:5000")
    assert h != config_hash({**base, "tp_size": 8}, ["--kv-cache-dtype=fp8"], (0.93, 0.88), 2, "10.0.0.1:5000")
    assert h != config_hash(base, [], (0.93, 0.88), 2, "10.0.0.1:5000")
    assert h != config_hash(base, ["--kv-cache-dtype=fp8"], (0.93, 0.85), 2, "10.0.0.1:5000")
    assert h != config_hash(base, ["--kv-cache-dtype=fp8"], (0.93, 0.88), 2, "10.0.0.2:5000")


# -- the leader's decision -------------------------------------------------------------------

POLICY = PolicyConfig(backoff_initial_s=10.0, backoff_jitter=0.0, max_crashes=3)


def test_the_group_steps_down_once_for_the_root_cause_and_backs_off_once() -> None:
    ended = replace(first_generation(0.93, 48, "h", "n0"), ended="node 1: cuda_oom_runtime")
    echo = Report(0, 1, diagnose(NODE0_ECHO, exit_status=ExitStatus(code=137), phase=Phase.SERVING), 40)
    oom = report(1, Cause.CUDA_OOM_RUNTIME, 41, "torch.OutOfMemoryError: CUDA out of memory")
    nxt = next_generation(ended, [echo, oom], POLICY, leader="n1", jitter_sample=0.5)
    assert (nxt.number, nxt.fraction, nxt.hicache_size_gb, nxt.gave_up) == (2, 0.88, 48, False)
    assert nxt.delay_s == 10.0 and nxt.failures == 1 and nxt.oom_fractions == (0.93,)
    assert nxt.root_cause is not None and nxt.root_cause["node_rank"] == 1 and nxt.root_cause["rank"] == "memory"
    assert nxt.reason.startswith("node 1: a CUDA OOM while serving: mem_fraction_static 0.93 -> 0.88")
    # the streak grows generation after generation, and the budget ends it
    again = next_generation(replace(nxt, ended="x"), [echo], POLICY, leader="n1", jitter_sample=0.5)
    assert (again.fraction, again.failures, again.delay_s) == (0.88, 2, 20.0)
    last = next_generation(replace(again, ended="x"), [echo], POLICY, leader="n1", jitter_sample=0.5)
    assert last.gave_up and "3 crashes" in last.reason
    # a generation that served stable_after_s starts the streak afresh
    calm = next_generation(replace(again, ended="x", stable=True), [echo], POLICY, leader="n1", jitter_sample=0.5)
    assert calm.failures == 1 and not calm.gave_up


def test_a_dead_gpu_on_any_node_gives_the_group_up_and_a_lost_node_is_a_plain_restart() -> None:
    ended = replace(first_generation(0.93, 0, "h", "n0"), ended="node 1: gpu_hw_error")
    dead = next_generation(ended, [report(0, Cause.NCCL_ERROR, 3), report(1, Cause.GPU_HW_ERROR, 4)], POLICY,
                           leader="n0", jitter_sample=0.5)
    assert dead.gave_up and dead.root_cause is not None and dead.root_cause["node_rank"] == 1
    lost = next_generation(replace(ended, ended="node 1 lost: its lease expired", lost_node=1),
                           [report(0, Cause.OTHER, 5, GROUP_STOP)], POLICY, leader="n0", jitter_sample=0.5)
    assert (lost.fraction, lost.gave_up) == (0.93, False)  # a plain restart
    assert lost.root_cause is not None and lost.root_cause["node_rank"] == 1  # the lost node, not node 0's stop
    assert lost.reason.startswith("node 1: an unrecognised error")
    nobody = next_generation(replace(ended, ended="x"), [], POLICY, leader="n0", jitter_sample=0.5)
    assert nobody.root_cause is None and nobody.reason.startswith("the group: ")


# -- a node's core in a group ------------------------------------------------------------------

GROUP = {"name": "kimi", "node_rank": 1, "nnodes": 2, "dist_init_addr": "10.0.0.1:5000"}
ETCD = {"endpoints": ["127.0.0.1:2379"]}


class Node:
    def __init__(self) -> None:
        self.cfg = build_config({"server": {"model_path": "/m", "tp_size": 8, "mem_fraction_static": 0.93},
                                 "group": GROUP, "etcd": ETCD})
        self.core = Core.initial(Learned.initial(self.cfg))
        self.now = 100.0

    def send(self, event: Any) -> list[Any]:
        self.now += 1
        ctx = Ctx(now=self.now, cfg=self.cfg, rng=random.Random(0), wall_time="2026-11-30T03:00:00Z")
        self.core, actions = step(self.core, event, ctx)
        return actions


def test_a_node_waits_for_the_leader_and_launches_with_the_groups_flags() -> None:
    node = Node()
    node.send(Boot())
    assert node.core.state is State.WAITING  # nothing launched before the leader's decision
    actions = node.send(GroupLaunch(1, 0.88, 0, "the group's first generation"))
    assert node.core.state is State.PREPARING and node.core.generation == 1
    assert any(isinstance(a, Prepare) for a in actions) and any(isinstance(a, Persist) for a in actions)
    launch = next(a for a in node.send(Prepared()) if isinstance(a, Launch))
    argv = list(launch.argv)
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.88"  # the group's, not its own 0.93
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--dist-init-addr") + 1] == "10.0.0.1:5000"
    assert node.send(GroupLaunch(1, 0.85, 0)) == [] and node.core.state is State.STARTING  # not twice


def test_a_node_whose_server_dies_reports_and_waits_never_relaunching_alone() -> None:
    node = Node()
    node.send(Boot())
    node.send(GroupLaunch(1, 0.93, 0))
    node.send(Prepared())
    node.send(Launched(4242))
    node.send(ProbeResult(True))
    assert node.core.state is State.READY
    died = Diagnosed(ExitStatus(signal=9), Diagnosis(Cause.CUDA_OOM_RUNTIME, Phase.SERVING, evidence=("CUDA out of memory",)))
    actions = node.send(died)
    assert node.core.state is State.WAITING
    (rep,) = [a for a in actions if isinstance(a, GroupReport)]
    assert rep.generation == 1 and rep.diagnosis.cause is Cause.CUDA_OOM_RUNTIME
    assert not any(isinstance(a, SetTimer) and a.name is Timer.BACKOFF for a in actions)  # the leader decides
    assert node.core.learned.fraction == 0.93  # nothing stepped alone
    assert node.send(TimerFired(Timer.BACKOFF)) == [] and node.send(RestartRequested("op")) == []


def test_the_generations_end_drains_a_serving_node_and_reports_it_as_an_echo() -> None:
    node = Node()
    node.send(Boot())
    node.send(GroupLaunch(3, 0.93, 0))
    node.send(Prepared())
    node.send(Launched(4242))
    node.send(ProbeResult(True))
    assert node.send(GroupEnded(2, "old")) == []  # another generation's end is not ours
    actions = node.send(GroupEnded(3, "node 0: cuda_oom_runtime"))
    assert node.core.state is State.RESTARTING and any(isinstance(a, StopServer) for a in actions)
    actions = node.send(Diagnosed(ExitStatus(code=0), Diagnosis(Cause.OTHER, Phase.SERVING)))
    assert node.core.state is State.WAITING
    (rep,) = [a for a in actions if isinstance(a, GroupReport)]
    assert rank_of(rep.diagnosis) is Rank.ECHO and rep.generation == 3
    assert not [a for a in actions if isinstance(a, Emit) and a.event.kind == "crash"]  # a stop, not a crash
    node.send(GroupLaunch(4, 0.88, 0))
    assert node.core.state is State.PREPARING and node.core.learned.fraction == 0.88
    node.send(GroupGaveUp("gpu_hw_error on node 0"))
    assert node.core.state is State.GAVE_UP


def test_a_rank_killed_with_nothing_logged_outranks_its_peers_echo() -> None:
    """Node 1's main SIGKILLed while serving logs nothing; node 0 logs the peer's loss. The
    kill is node 1's own death (local), named in the reason, whichever report came first."""
    killed = Diagnosis(cause=Cause.OTHER, phase=Phase.SERVING, killed="SIGKILL", basis="signal",
                       evidence=("main process killed by SIGKILL after it was ready; no error was logged since",))
    echo = Diagnosis(cause=Cause.NCCL_ERROR, phase=Phase.SERVING,
                     evidence=("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",))
    assert rank_of(killed) is Rank.LOCAL and rank_of(echo) is Rank.ECHO
    reports = [Report(0, 1, echo, revision=10), Report(1, 1, killed, revision=12)]
    assert root_cause(reports).node_rank == 1
    ended = replace(first_generation(0.93, 48, "h", "n0"), ended="node 1: killed")
    gen = next_generation(ended, reports, POLICY, leader="h0", jitter_sample=0.5)
    assert gen.reason.startswith("node 1 (killed by SIGKILL, no error logged)")
