"""A multi-node group's coordination through etcd (issue 16): the I/O around ``core/group.py``.

Every node's daemon owns its rank and runs one ``GroupSync``. Everything the nodes share is
in etcd, under ``/sglang-supervisor/groups/<name>/``:

- ``nodes/<rank>``: the node's state, pid, the generation it runs, its config's hash; bound
  to its lease, so a node whose daemon (or host) died disappears after ``lease_ttl_s``;
- ``election/``: etcd's election recipe; the oldest candidate leads (any node may);
- ``generation``: the generation every node launches (its managed flags, why, the root cause
  of the one before), written by the leader alone, in compare-and-swap transactions;
- ``reports/<generation>/<rank>``: how each node's rank ended; etcd's revision orders them.

A node reacts to ``generation`` (``GroupLaunch``, ``GroupEnded``, ``GroupGaveUp`` into its
core) and reports the end of its rank. The leader ends a generation when a report arrives or
a node's key vanishes, waits until every node reported (or the stop grace passed), chooses
the root cause and writes the next generation after one backoff. etcd is the only
coordinator: no node talks to another.

When etcd cannot be reached nothing is decided and nothing is posted: each node keeps its
server and starts nothing new, and says so once (``group_etcd_unreachable``). When etcd
returns, the node gets a new lease, registers again and stands for leader again; a new
leader gives every node one lease TTL to register before it counts one as lost, so nothing
is restarted because leases lapsed during the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from supervisor.adapters.ports import Etcd, EtcdError, KeyValue, Lease
from supervisor.aio import cancel_and_wait, within
from supervisor.core import events as ev
from supervisor.core.config import Config
from supervisor.core.fleet import parse_flags
from supervisor.core.group import (
    GROUP_PREFIX,
    Generation,
    Report,
    config_hash,
    diagnosis_from_dict,
    first_generation,
    next_generation,
)
from supervisor.core.machine import Event, GroupEnded, GroupGaveUp, GroupLaunch
from supervisor.core.model import Diagnosis, State
from supervisor.core.policy import exponential_backoff

TICK_S = 0.5  # the leader looks again at least this often
RECONNECT_MAX_S = 5.0


@dataclass(frozen=True, slots=True)
class NodeInfo:
    rank: int
    state: str
    generation: int
    config_hash: str
    host: str = ""
    pid: int | None = None


@dataclass(slots=True)
class View:
    """The group as the last read of etcd saw it."""

    generation: Generation | None = None
    generation_rev: int = 0  # its mod revision (0: absent), for compare-and-swap
    nodes: dict[int, NodeInfo] = field(default_factory=dict)
    reports: dict[int, dict[int, KeyValue]] = field(default_factory=dict)  # generation -> rank -> report


class GroupSync:
    """One node's part of the group (see the module docstring)."""

    def __init__(
        self, etcd: Etcd, cfg: Config, *, config_hash: str, host: str, post: Callable[[Event], None],
        emit: Callable[[ev.Event], None], rng: random.Random | None = None,
    ) -> None:
        self._etcd = etcd
        self.cfg = cfg
        self.group = cfg.group
        self.prefix = f"{GROUP_PREFIX}/{cfg.group.name}"
        self.config_hash = config_hash
        self.host = host
        self._post = post
        self.emit = emit
        self.rng = rng or random.Random()
        self.view = View()
        self.etcd_up = False
        self.leading = False
        self._lease: Lease | None = None
        self._mine = NodeInfo(cfg.group.node_rank, str(State.STOPPED), 0, config_hash, host)
        self._node_dirty = True
        self._kick = asyncio.Event()
        self._pending_reports: list[tuple[str, bytes]] = []
        self._posted: set[tuple[str, int]] = set()  # (what, generation) already posted to the core
        self._down_since: float | None = None
        self._head_ready = False

    # -- what the unit tells us and asks --------------------------------------------------

    def node_state(self, state: State, pid: int | None, generation: int) -> None:
        """The core's state changed: our node key says so at the next write."""
        self._mine = replace(self._mine, state=str(state), pid=pid, generation=generation)
        self._node_dirty = True
        self._kick.set()

    def report(self, generation: int, diagnosis: Diagnosis, exit_text: str) -> None:
        """How our rank of ``generation`` ended; written as soon as etcd answers (kept until then)."""
        key = f"{self.prefix}/reports/{generation}/{self.group.node_rank}"
        body = {"node_rank": self.group.node_rank, "generation": generation, "host": self.host,
                "exit": exit_text, "diagnosis": diagnosis.to_dict()}
        self._pending_reports.append((key, json.dumps(body).encode()))
        self._kick.set()

    def head_ready(self) -> bool:
        """Node 0 (the only real ``/health``) is READY in the generation we run: the group's
        health for a node >= 1, whose own /health is a dummy. While etcd is away, the last
        answer stands: no node acts on what it cannot see."""
        if not self.etcd_up:
            return self._head_ready
        head = self.view.nodes.get(0)
        self._head_ready = head is not None and head.state == str(State.READY) and head.generation == self._mine.generation
        return self._head_ready

    async def aclose(self) -> None:
        """The daemon is leaving: give up our lease now (our node key and our candidacy go
        with it), so the group notices at once rather than after ``lease_ttl_s``."""
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(EtcdError, TimeoutError):
                await within(self._etcd.revoke(lease), self.cfg.etcd.timeout_s)

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Sessions with etcd, one after another, until cancelled; an outage between them."""
        failures = 0
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self._session()
            except EtcdError as exc:
                failures += 1
                if self.etcd_up or self._down_since is None:
                    self._down_since = loop.time()
                    self.emit(ev.GroupEtcdUnreachable(error=str(exc)[:300]))
                self.etcd_up = False
                self.leading = False
                self._lease = None
                await asyncio.sleep(exponential_backoff(failures - 1, initial=0.5, factor=2.0, maximum=RECONNECT_MAX_S,
                                                        jitter=(0.5, 1.0), sample=self.rng.random()))

    async def _session(self) -> None:
        etcd = self._etcd
        await etcd.connect()
        lease = await etcd.grant(self.group.lease_ttl_s)
        self._lease = lease
        self._node_dirty = True
        await self.refresh()
        loop = asyncio.get_running_loop()
        if self._down_since is not None:
            self.emit(ev.GroupEtcdRecovered(down_s=round(loop.time() - self._down_since, 3)))
            self._down_since = None
        self.etcd_up = True
        self.emit(ev.GroupJoined(group=self.group.name, node_rank=self.group.node_rank))
        tasks = [
            asyncio.create_task(etcd.keep_alive(lease), name="group-lease"),
            asyncio.create_task(self._watch(), name="group-watch"),
            asyncio.create_task(self._follow(), name="group-follow"),
            asyncio.create_task(self._lead(lease), name="group-lead"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # an EtcdError ends the session
        finally:
            await cancel_and_wait(tasks)

    async def _watch(self) -> None:
        """Every change under the group's prefix wakes the follower and the leader."""
        async for _change in self._etcd.watch_prefix(self.prefix + "/"):
            self._kick.set()

    async def _follow(self) -> None:
        """Write what we owe (our node key, reports), read the group, react as a node."""
        while True:
            with contextlib.suppress(TimeoutError):
                await within(self._kick.wait(), TICK_S)
            self._kick.clear()
            await self._write_own()
            await self.refresh()
            self._react()

    async def _write_own(self) -> None:
        lease = self._lease
        if self._node_dirty and lease is not None:
            m = self._mine
            body = {"state": m.state, "generation": m.generation, "config_hash": m.config_hash, "host": m.host,
                    "pid": m.pid}
            self._node_dirty = False
            await self._etcd.put(f"{self.prefix}/nodes/{m.rank}", json.dumps(body).encode(), lease)
        while self._pending_reports:
            key, value = self._pending_reports[0]
            await self._etcd.put_if(key, value, 0)  # once: a report already there stays first
            self._pending_reports.pop(0)

    async def write_generation(self, gen: Generation, expect_rev: int) -> None:
        """The leader's write: ``gen`` if the record is still at ``expect_rev`` (0: absent)."""
        await self._etcd.put_if(f"{self.prefix}/generation", gen.to_json(), expect_rev)
        self._kick.set()

    async def refresh(self) -> None:
        kvs, _rev = await self._etcd.get_prefix(self.prefix + "/")
        view = View()
        for kv in kvs:
            name = kv.key[len(self.prefix) + 1:]
            try:
                if name == "generation":
                    view.generation = Generation.from_json(kv.value)
                    view.generation_rev = kv.mod_revision
                elif name.startswith("nodes/"):
                    d = json.loads(kv.value)
                    rank = int(name.split("/", 1)[1])
                    view.nodes[rank] = NodeInfo(rank, str(d.get("state")), int(d.get("generation", 0)),
                                                str(d.get("config_hash", "")), str(d.get("host", "")), d.get("pid"))
                elif name.startswith("reports/"):
                    _, number, node = name.split("/")
                    view.reports.setdefault(int(number), {})[int(node)] = kv
            except (ValueError, KeyError, TypeError):
                continue  # a record we cannot read is not acted on
        self.view = view

    # -- a node's reactions -----------------------------------------------------------------

    def _once(self, what: str, number: int, event: Event) -> None:
        if (what, number) not in self._posted:
            self._posted.add((what, number))
            self._post(event)

    def _react(self) -> None:
        gen = self.view.generation
        mine = self._mine
        if gen is None:
            return
        if gen.config_hash != self.config_hash:
            self._once("refused", gen.number, GroupGaveUp(
                f"this node's config differs from the group's on a group-relevant setting (model, tp/dp, fraction, "
                f"host cache, memory flags, ladder, nnodes, dist_init_addr): config hash {self.config_hash}, "
                f"the group's {gen.config_hash}"))
            return
        if gen.gave_up:
            self._once("gave_up", gen.number, GroupGaveUp(gen.reason))
        elif gen.ended:
            if mine.generation == gen.number:
                self._once("ended", gen.number, GroupEnded(gen.number, gen.ended))
        elif gen.number > mine.generation and mine.state == str(State.WAITING):
            self._once("launch", gen.number, GroupLaunch(gen.number, gen.fraction, gen.hicache_size_gb, gen.reason))

    # -- the leader -------------------------------------------------------------------------

    async def _lead(self, lease: Lease) -> None:
        await self._etcd.campaign(f"{self.prefix}/election", lease, self.host.encode())
        self.leading = True
        self.emit(ev.GroupLeader(group=self.group.name, node_rank=self.group.node_rank))
        leader = _Leader(self)
        while True:
            await leader.decide()
            await asyncio.sleep(TICK_S / 2)


class _Leader:
    """The leader's decisions over the group's records (its clock is used only for waits)."""

    def __init__(self, sync: GroupSync) -> None:
        self.s = sync
        loop = asyncio.get_running_loop()
        self.now = loop.time
        # Nodes get one lease TTL to register after a new leader (or etcd) comes back.
        self.grace_until = self.now() + sync.group.lease_ttl_s
        self.ended_seen: dict[int, float] = {}
        self.ready_since: dict[int, float] = {}
        self.running_since: dict[int, float] = {}  # generation -> when this leader first saw it running

    async def decide(self) -> None:
        s = self.s
        await s.refresh()
        view = s.view
        nodes = view.nodes
        gen = view.generation
        if gen is None:
            everyone = len(nodes) == s.group.nnodes and all(n.config_hash == s.config_hash for n in nodes.values())
            if everyone:
                first = first_generation(s.cfg.server.mem_fraction_static, s.cfg.server.hicache_size_gb,
                                         s.config_hash, s.host)
                await self._write(first, 0)
            return
        if gen.gave_up:
            return
        if not gen.ended:
            await self._watch_running(gen, nodes, view)
            return
        await self._next(gen, nodes, view)

    async def _watch_running(self, gen: Generation, nodes: dict[int, NodeInfo], view: View) -> None:
        reports = view.reports.get(gen.number, {})
        why, lost_node = "", None
        if reports:
            first = min(reports.values(), key=lambda kv: kv.create_revision)
            d = json.loads(first.value)
            why = f"node {d.get('node_rank')}: {d.get('diagnosis', {}).get('cause', 'other')}"
        elif self.now() > max(self.grace_until, self.running_since.setdefault(gen.number, self.now())
                              + self.s.group.lease_ttl_s):
            # A node absent when a generation starts (its daemon being restarted) gets one
            # lease TTL to join it before it is lost, as every node does when a leader starts.
            lost = [r for r in range(self.s.group.nnodes) if r not in nodes]
            if lost:
                lost_node = lost[0]
                why = f"node {lost_node} lost: its lease expired (its daemon or its host is gone)"
        if why:
            await self._write(replace(gen, ended=why, lost_node=lost_node), view.generation_rev)
            self.s.emit(ev.GroupGenerationEnded(group=self.s.group.name, number=gen.number, reason=why))
            return
        head = nodes.get(0)
        if head is not None and head.state == str(State.READY) and head.generation == gen.number and not gen.stable:
            since = self.ready_since.setdefault(gen.number, self.now())
            if self.now() - since >= self.s.cfg.policy.stable_after_s:
                await self._write(replace(gen, stable=True), view.generation_rev)

    async def _next(self, gen: Generation, nodes: dict[int, NodeInfo], view: View) -> None:
        s = self.s
        seen = self.ended_seen.setdefault(gen.number, self.now())
        reports = view.reports.get(gen.number, {})
        waiting_for = [r for r, n in nodes.items() if r not in reports and n.generation == gen.number
                       and n.state not in (str(State.WAITING), str(State.GAVE_UP))]
        patience = s.cfg.server.stop_grace_s + s.group.lease_ttl_s + 5.0
        if waiting_for and self.now() - seen < patience:
            return  # the others are still stopping their ranks
        parsed = []
        for rank, kv in reports.items():
            d = json.loads(kv.value)
            parsed.append(Report(rank, gen.number, diagnosis_from_dict(d.get("diagnosis") or {}), kv.create_revision,
                                 str(d.get("host", ""))))
        nxt = next_generation(gen, parsed, s.cfg.policy, leader=s.host, jitter_sample=s.rng.random())
        root = nxt.root_cause or {}
        s.emit(ev.GroupGeneration(
            group=s.group.name, number=nxt.number, mem_fraction_static=nxt.fraction,
            hicache_size_gb=nxt.hicache_size_gb, reason=nxt.reason, delay_s=nxt.delay_s, gave_up=nxt.gave_up,
            root_node=root.get("node_rank"),
            root_cause=diagnosis_from_dict(root.get("diagnosis") or {}).cause if root else None,
            reports=tuple({"node": r.node_rank, "cause": str(r.diagnosis.cause), "rank": r.rank.name.lower(),
                           "revision": r.revision} for r in sorted(parsed, key=lambda r: r.revision)),
        ))
        if nxt.delay_s > 0:
            await asyncio.sleep(nxt.delay_s)  # one backoff for the whole group
        await self._write(nxt, view.generation_rev)

    async def _write(self, gen: Generation, expect_rev: int) -> None:
        """Compare-and-swap: written only over the record we decided from (a second writer,
        a leader that lost its place, loses the race and looks again)."""
        await self.s.write_generation(gen, expect_rev)


def node_config_hash(cfg: Config) -> str:
    """What this node's config says about the group (``core.group.config_hash``)."""
    flags = parse_flags(cfg.server.extra_args)
    server = {"model_path": cfg.server.model_path, "tp_size": cfg.server.tp_size, "dp_size": cfg.server.dp_size,
              "hicache_size_gb": cfg.server.hicache_size_gb, "mem_fraction_static": cfg.server.mem_fraction_static}
    return config_hash(server, [f"{k}={v}" for k, v in sorted(flags.items())], cfg.policy.fraction_ladder,
                       cfg.group.nnodes, cfg.group.dist_init_addr)


__all__ = ["GroupSync", "NodeInfo", "View", "node_config_hash"]
