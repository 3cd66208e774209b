"""The group leader's decisions (``core.group.leader_step``), as a table: what etcd holds,
the time, what the leader remembers -> what it writes, what it logs, when it looks again.

Each rule of docs/group.md is one row or two: the first generation once every node is
there; a generation ends at its first report or a lost node; a node absent at a
generation's start, or when a leader starts, gets one lease TTL; node 0 READY long enough
marks it stable; an ended generation waits for the running nodes' reports (or its
patience); the next one is written after its backoff, as a due write, never a sleep.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace

import pytest

from supervisor.adapters.ports import EtcdError, Lease
from supervisor.aio import Backoff
from supervisor.core import events as ev
from supervisor.core.config import PolicyConfig, build_config
from supervisor.core.group import (
    Generation,
    GenerationWrite,
    GroupView,
    LeaderMemo,
    LeaderRules,
    LeaderStep,
    NodeInfo,
    Report,
    first_generation,
    leader_step,
)
from supervisor.core.model import Cause, Diagnosis, Phase, State
from supervisor.services import grouping
from supervisor.services.grouping import GroupSync

TTL = 15.0
RULES = LeaderRules(group="kimi", nnodes=2, lease_ttl_s=TTL, stop_grace_s=30.0, stable_after_s=600.0,
                    policy=PolicyConfig(backoff_initial_s=10.0, backoff_jitter=0.0, max_crashes=3),
                    config_hash="h", host="n0", fraction=0.93, hicache_size_gb=48)
GEN1 = first_generation(0.93, 48, "h", "n0")
REV = 7  # the generation record's revision in the views below


def node(rank: int, state: State = State.READY, generation: int = 1, config_hash: str = "h") -> NodeInfo:
    return NodeInfo(rank, str(state), generation, config_hash)


def both(state: State = State.READY, generation: int = 1) -> dict[int, NodeInfo]:
    return {0: node(0, state, generation), 1: node(1, state, generation)}


def view(gen: Generation | None = GEN1, nodes: Mapping[int, NodeInfo] | None = None,
         reports: Mapping[int, Report] | None = None) -> GroupView:
    return GroupView(gen, REV if gen is not None else 0, both() if nodes is None else nodes,
                     {gen.number: dict(reports)} if gen is not None and reports else {})


def rpt(rank: int, cause: Cause, revision: int, *evidence: str) -> Report:
    return Report(rank, 1, Diagnosis(cause, Phase.SERVING, evidence=evidence), revision)


def at(v: GroupView, now: float, memo: LeaderMemo | None = None) -> LeaderStep:
    return leader_step(v, now, memo or LeaderMemo.start(0.0, RULES), RULES, jitter_sample=0.5)


def written(step: LeaderStep) -> Generation:
    assert len(step.writes) == 1, step
    return step.writes[0].generation


# -- the first generation --------------------------------------------------------------------

@pytest.mark.parametrize(("nodes", "writes"), [
    ({0: node(0, State.WAITING, 0)}, False),  # node 1 not registered yet
    ({0: node(0, State.WAITING, 0), 1: node(1, State.WAITING, 0, config_hash="other")}, False),  # a config differs
    ({0: node(0, State.WAITING, 0), 1: node(1, State.WAITING, 0)}, True),
])
def test_the_first_generation_waits_for_every_node_with_the_same_config(
    nodes: dict[int, NodeInfo], writes: bool,
) -> None:
    step = at(view(None, nodes), 1.0)
    if writes:
        assert step.writes == (GenerationWrite(first_generation(0.93, 48, "h", "n0"), 0),)
    else:
        assert step.writes == () and step.next_due is None  # the watch wakes it when a node registers


# -- a generation running --------------------------------------------------------------------

def test_the_first_report_ends_the_generation_whoever_else_reports_later() -> None:
    step = at(view(reports={1: rpt(1, Cause.CUDA_OOM_RUNTIME, 41), 0: rpt(0, Cause.NCCL_ERROR, 42)}), 5.0)
    ended = written(step)
    assert ended.ended == "node 1: cuda_oom_runtime" and ended.lost_node is None
    assert step.writes[0].expect_rev == REV  # compare-and-swap over the record it decided from
    assert step.events == (ev.GroupGenerationEnded(group="kimi", number=1, reason="node 1: cuda_oom_runtime"),)


@pytest.mark.parametrize(("leader_since", "running_since", "now", "lost"), [
    # a new leader gives every node one lease TTL to register
    (0.0, 0.0, TTL - 0.1, False),
    (0.0, 0.0, TTL, True),
    # a node absent when a generation starts (its daemon being restarted) gets one lease TTL
    # from when the leader first saw the generation running, however old the leader is (the
    # bug fixed in c8ede79: declared lost 0.7 s into the generation it was about to join)
    (0.0, 100.0, 100.7, False),
    (0.0, 100.0, 100.0 + TTL, True),
])
def test_a_missing_node_is_lost_one_lease_ttl_after_the_later_of_the_leaders_start_and_the_generations(
    leader_since: float, running_since: float, now: float, lost: bool,
) -> None:
    memo = replace(LeaderMemo.start(leader_since, RULES), running_since={1: running_since})
    step = at(view(nodes={0: node(0)}), now, memo)
    if lost:
        ended = written(step)
        assert ended.lost_node == 1 and ended.ended.startswith("node 1 lost: its lease expired")
    else:
        assert step.writes == () and step.next_due == max(leader_since + TTL, running_since + TTL)


def test_the_generations_running_time_starts_when_the_leader_first_sees_it() -> None:
    first = at(view(nodes={0: node(0)}), 50.0)
    assert first.memo.running_since == {1: 50.0} and first.next_due == 50.0 + TTL
    assert at(view(nodes={0: node(0)}), 50.0 + TTL, first.memo).writes[0].generation.lost_node == 1


def test_node_0_ready_for_stable_after_s_marks_the_generation_stable_once() -> None:
    first = at(view(), 20.0)
    assert first.writes == () and first.next_due == 20.0 + 600.0
    step = at(view(), 620.0, first.memo)
    assert written(step) == replace(GEN1, stable=True)
    assert at(view(replace(GEN1, stable=True)), 700.0, step.memo).writes == ()  # once
    # a node 0 not READY, or READY in an older generation, starts no clock
    for head in (node(0, State.STARTING), node(0, State.READY, generation=0)):
        assert at(view(nodes={0: head, 1: node(1)}), 20.0).memo.ready_since == {}


# -- a generation ended -------------------------------------------------------------------------

ENDED = replace(GEN1, ended="node 1: cuda_oom_runtime")
OOM = rpt(1, Cause.CUDA_OOM_RUNTIME, 41, "torch.OutOfMemoryError: CUDA out of memory")
ECHO = rpt(0, Cause.NCCL_ERROR, 42, "RuntimeError: gloo Connection closed by peer")


def test_an_ended_generation_waits_for_the_running_nodes_reports_until_its_patience() -> None:
    patience = RULES.patience_s
    waiting = at(view(ENDED, reports={1: OOM}), 10.0)
    assert waiting.writes == () and waiting.events == () and waiting.next_due == 10.0 + patience
    # a node WAITING or GAVE_UP owes no report
    done = at(view(ENDED, nodes={0: node(0, State.WAITING), 1: node(1, State.WAITING)}, reports={1: OOM}), 10.0)
    assert done.events and done.events[0].kind == "group_generation"
    # past its patience the leader decides without the missing report
    late = at(view(ENDED, reports={1: OOM}), 10.0 + patience, waiting.memo)
    assert late.events and late.events[0].kind == "group_generation"


def test_the_next_generation_is_decided_once_and_written_when_its_backoff_is_due() -> None:
    v = view(ENDED, reports={1: OOM, 0: ECHO})
    decided = at(v, 10.0)
    assert decided.writes == () and decided.next_due == 20.0  # backoff_initial_s, no jitter
    (event,) = decided.events
    assert isinstance(event, ev.GroupGeneration)
    assert (event.number, event.mem_fraction_static, event.root_node, event.root_cause) == \
        (2, 0.88, 1, Cause.CUDA_OOM_RUNTIME)
    assert [r["rank"] for r in event.reports] == ["memory", "echo"]
    early = at(v, 15.0, decided.memo)
    assert early.writes == () and early.events == () and early.next_due == 20.0  # no second decision
    due = at(v, 20.0, decided.memo)
    nxt = written(due)
    assert (nxt.number, nxt.fraction, nxt.oom_fractions, due.writes[0].expect_rev) == (2, 0.88, (0.93,), REV)
    assert due.events == ()


def test_a_pending_generation_is_dropped_when_another_writer_moves_the_record() -> None:
    decided = at(view(ENDED, reports={1: OOM}, nodes=both(State.WAITING)), 10.0)
    assert decided.memo.pending is not None
    moved = replace(view(replace(ENDED, number=2, ended=""), nodes=both(State.WAITING, 1)), generation_rev=REV + 1)
    step = at(moved, 20.0, decided.memo)
    assert step.memo.pending is None and step.writes == ()


def test_after_a_write_nothing_is_decided_again_until_the_watch_brings_the_record_back() -> None:
    step = at(view(reports={1: OOM}), 5.0)
    assert step.events  # the generation ended
    stale = at(view(reports={1: OOM}), 6.0, step.memo)  # the same view: the write has not come back yet
    assert stale.writes == () and stale.events == ()
    back = at(replace(view(ENDED, reports={1: OOM}), generation_rev=REV + 1), 6.0, step.memo)
    assert back.memo.acted_on is None


def test_a_group_that_gave_up_is_left_alone() -> None:
    step = at(view(replace(ENDED, gave_up=True), reports={1: OOM}), 1e6)
    assert step.writes == () and step.events == () and step.next_due is None


# -- the node's writes -------------------------------------------------------------------------

class RecordingEtcd:
    """The two writes a node makes, in order."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    async def put(self, key: str, value: bytes, lease: object = None) -> int:
        self.keys.append(key)
        return len(self.keys)

    async def put_if(self, key: str, value: bytes, mod_revision: int, lease: object = None) -> int:
        self.keys.append(key)
        return len(self.keys)


def test_a_node_writes_the_report_of_its_rank_before_it_says_it_waits() -> None:
    """The leader wakes at every write: a node seen WAITING with no report would be decided
    without (its peer's echo, or nothing, named the root cause)."""
    async def scenario() -> list[str]:
        etcd = RecordingEtcd()
        cfg = build_config({"server": {"model_path": "/m"}, "etcd": {"endpoints": ["127.0.0.1:2379"]},
                            "group": {"name": "g", "node_rank": 1, "nnodes": 2, "dist_init_addr": "h:1"}})
        sync = GroupSync(etcd, cfg, config_hash="h", host="n1", post=lambda e: None,  # type: ignore[arg-type]
                         emit=lambda e: None)
        sync._lease = Lease(1, 15)
        sync.node_state(State.WAITING, None, 1)  # the core's order: its state, then the report
        sync.report(1, Diagnosis(Cause.OTHER, Phase.SERVING), "killed by SIGKILL")
        await sync._write_own()
        return etcd.keys

    assert asyncio.run(scenario()) == ["/sglang-supervisor/groups/g/reports/1/1", "/sglang-supervisor/groups/g/nodes/1"]


class FlakyEtcd:
    """etcd that refuses ``refusals`` connects, then serves a session until ``drop`` is set
    (its lease's keep-alive then fails), then refuses again."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.connects = 0
        self.drop = asyncio.Event()

    async def connect(self) -> None:
        self.connects += 1
        if self.refusals > 0:
            self.refusals -= 1
            raise EtcdError("etcd 127.0.0.1:2379: unreachable")

    async def grant(self, ttl_s: int) -> Lease:
        return Lease(self.connects, ttl_s)

    async def get_prefix(self, prefix: str) -> tuple[list[object], int]:
        return [], 1

    async def keep_alive(self, lease: Lease) -> None:
        await self.drop.wait()
        self.drop.clear()
        self.refusals = 3
        raise EtcdError("etcd 127.0.0.1:2379: lease lost")

    async def watch_prefix(self, prefix: str, start_revision: int = 0) -> AsyncIterator[object]:
        await asyncio.Event().wait()
        yield None

    async def campaign(self, prefix: str, lease: Lease, value: bytes = b"") -> None:
        await asyncio.Event().wait()

    async def put(self, key: str, value: bytes, lease: object = None) -> int:
        return 1

    async def put_if(self, key: str, value: bytes, mod_revision: int, lease: object = None) -> int:
        return 1


def test_an_etcd_outage_is_reported_once_when_it_begins_and_once_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three refused connects are one group_etcd_unreachable; the session that follows says
    group_etcd_recovered once; a lost lease begins the next outage, reported once again."""
    monkeypatch.setattr(grouping, "RECONNECT", Backoff(initial=0.001, maximum=0.004))

    async def scenario() -> list[str]:
        etcd = FlakyEtcd(refusals=3)
        cfg = build_config({"server": {"model_path": "/m"}, "etcd": {"endpoints": ["127.0.0.1:2379"]},
                            "group": {"name": "g", "node_rank": 1, "nnodes": 2, "dist_init_addr": "h:1"}})
        seen: list[str] = []
        sync = GroupSync(etcd, cfg, config_hash="h", host="n1", post=lambda e: None,  # type: ignore[arg-type]
                         emit=lambda e: seen.append(e.kind), rng=random.Random(0))
        task = asyncio.create_task(sync.run())
        async with asyncio.timeout(30):
            while seen.count("group_joined") < 1:
                await asyncio.sleep(0.001)
            assert sync.etcd_up and etcd.connects == 4
            etcd.drop.set()
            while seen.count("group_joined") < 2:
                await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert etcd.connects == 8
        return seen

    seen = asyncio.run(scenario())
    assert seen == ["group_etcd_unreachable", "group_etcd_recovered", "group_joined",
                    "group_etcd_unreachable", "group_etcd_recovered", "group_joined"]
