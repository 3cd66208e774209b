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
from dataclasses import replace

from supervisor.adapters.ports import Etcd, EtcdError, KeyValue, Lease, ProbeOutcome, WatchEvent
from supervisor.aio import Backoff, Reconnect, TaskScope, within
from supervisor.core import events as ev
from supervisor.core.config import Config
from supervisor.core.fleet import parse_flags
from supervisor.core.group import (
    GROUP_PREFIX,
    Generation,
    GroupView,
    LeaderMemo,
    LeaderRules,
    NodeInfo,
    Report,
    config_hash,
    diagnosis_from_dict,
    leader_step,
)
from supervisor.core.messages import Event, GroupEnded, GroupGaveUp, GroupLaunch
from supervisor.core.model import Diagnosis, State

RECONNECT_MAX_S = 5.0
RECONNECT = Backoff(initial=0.5, maximum=RECONNECT_MAX_S)


class GroupSync:
    """One node's part of the group (see the module docstring)."""

    def __init__(
        self, etcd: Etcd, cfg: Config, *, config_hash: str, host: str, post: Callable[[Event], None],
        emit: Callable[[ev.Event], None], rng: random.Random | None = None, tasks: TaskScope | None = None,
        lease: Lease | None = None,
    ) -> None:
        """``lease``: the one a re-exec handed over (docs/upgrade.md), kept for the first
        session: the node key and the candidacy on it live on, and the group notices nothing."""
        self._etcd = etcd
        self._tasks = tasks or TaskScope("group")  # the unit's: each session's tasks are a child of it
        self.cfg = cfg
        self.group = cfg.group
        self.prefix = f"{GROUP_PREFIX}/{cfg.group.name}"
        self.config_hash = config_hash
        self.host = host
        self._post = post
        self.emit = emit
        self.rng = rng or random.Random()
        self.view = GroupView()
        self._records: dict[str, KeyValue] = {}  # what etcd holds under the prefix, kept by the watch
        self.etcd_up = False
        self.leading = False
        self._lease: Lease | None = None
        self._inherited = lease
        self._mine = NodeInfo(cfg.group.node_rank, str(State.STOPPED), 0, config_hash, host)
        self._node_dirty = True
        self._kick = asyncio.Event()  # the follower: something to write, or the view changed
        self._changed = asyncio.Event()  # the leader: the view changed
        self._pending_reports: list[tuple[str, bytes]] = []
        self._posted: set[tuple[str, int]] = set()  # (what, generation) already posted to the core
        # etcd's outages: group_etcd_unreachable once at the first failure, group_etcd_recovered
        # with its duration once a session is up again (they feed the link metric too).
        self._link = Reconnect(
            "group", RECONNECT, on_down=self._etcd_down, on_up=self._etcd_up, retry_on=EtcdError, rng=self.rng,
            clock=lambda: asyncio.get_running_loop().time(),
        )
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

    def head_prober(self, *, alive: Callable[[], bool], ready: Callable[[], bool]) -> HeadProber:
        """The prober of a node >= 1 (``HeadProber``): ``alive``, our server runs;
        ``ready``, our core is READY."""
        return HeadProber(self, alive, ready)

    @property
    def lease(self) -> Lease | None:
        """The lease of the session that runs (a re-exec hands it over)."""
        return self._lease

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
        await self._link.run(self._session)

    def _etcd_down(self, error: BaseException) -> None:
        self.emit(ev.GroupEtcdUnreachable(error=str(error)[:300]))

    def _etcd_up(self, down_s: float | None) -> None:
        if down_s is not None:
            self.emit(ev.GroupEtcdRecovered(down_s=down_s))

    async def _session(self) -> None:
        try:
            await self._connected_session()
        except EtcdError:
            self.etcd_up = False
            self.leading = False
            self._lease = None
            raise

    async def _connected_session(self) -> None:
        etcd = self._etcd
        await etcd.connect()
        # A lease a re-exec kept is refreshed at once by keep_alive (gone: an EtcdError, and
        # the next session grants a new one).
        lease, self._inherited = self._inherited or await etcd.grant(self.group.lease_ttl_s), None
        self._lease = lease
        self._node_dirty = True
        # One read, then one watch from the revision after it keeps the view current; the
        # prefix is read again only in the next session, after the watch (or etcd) is lost.
        kvs, revision = await etcd.get_prefix(self.prefix + "/")
        self._records = {kv.key: kv for kv in kvs}
        self._parse()
        self._link.connected()
        self.etcd_up = True
        self.emit(ev.GroupJoined(group=self.group.name, node_rank=self.group.node_rank, lease=f"{lease.id:x}"))
        self._kick.set()
        # The session's tasks live and die with it; their errors are read here (``on_failure``
        # leaves them to this wait): an EtcdError ends the session, and the reconnect loop
        # starts the next.
        session = self._tasks.child("group-session", on_failure=lambda _task: None)
        tasks = [
            session.spawn(etcd.keep_alive(lease), "group-lease"),
            session.spawn(self._watch(revision + 1), "group-watch"),
            session.spawn(self._follow(), "group-follow"),
            session.spawn(self._lead(lease), "group-lead"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # an EtcdError ends the session
        finally:
            await session.aclose()

    async def _watch(self, start_revision: int) -> None:
        """Every change under the group's prefix updates the view and wakes the follower and
        the leader."""
        async for change in self._etcd.watch_prefix(self.prefix + "/", start_revision):
            self._apply(change)
            self._parse()
            self._kick.set()
            self._changed.set()

    def _apply(self, change: WatchEvent) -> None:
        if change.kind == "delete":
            self._records.pop(change.key, None)
        else:
            self._records[change.key] = KeyValue(change.key, change.value, change.create_revision, change.revision)

    async def _follow(self) -> None:
        """Write what we owe (our node key, reports), react to the group as a node."""
        while True:
            await self._kick.wait()
            self._kick.clear()
            await self._write_own()
            self._react()

    async def _write_own(self) -> None:
        """Our reports first, then our node key: the leader, woken by each write, must never
        see us WAITING for the next generation without the report of the last one."""
        while self._pending_reports:
            key, value = self._pending_reports[0]
            await self._etcd.put_if(key, value, 0)  # once: a report already there stays first
            self._pending_reports.pop(0)
        lease = self._lease
        if self._node_dirty and lease is not None:
            m = self._mine
            body = {"state": m.state, "generation": m.generation, "config_hash": m.config_hash, "host": m.host,
                    "pid": m.pid}
            self._node_dirty = False
            await self._etcd.put(f"{self.prefix}/nodes/{m.rank}", json.dumps(body).encode(), lease)

    def _parse(self) -> None:
        """The view from the records: a record we cannot read is not acted on."""
        generation, generation_rev = None, 0
        nodes: dict[int, NodeInfo] = {}
        reports: dict[int, dict[int, Report]] = {}
        for kv in self._records.values():
            name = kv.key[len(self.prefix) + 1:]
            try:
                if name == "generation":
                    generation, generation_rev = Generation.from_json(kv.value), kv.mod_revision
                elif name.startswith("nodes/"):
                    d = json.loads(kv.value)
                    rank = int(name.split("/", 1)[1])
                    nodes[rank] = NodeInfo(rank, str(d.get("state")), int(d.get("generation", 0)),
                                           str(d.get("config_hash", "")), str(d.get("host", "")), d.get("pid"))
                elif name.startswith("reports/"):
                    _, number, node = name.split("/")
                    d = json.loads(kv.value)
                    reports.setdefault(int(number), {})[int(node)] = Report(
                        int(node), int(number), diagnosis_from_dict(d.get("diagnosis") or {}), kv.create_revision,
                        str(d.get("host", "")))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
        self.view = GroupView(generation, generation_rev, nodes, reports)

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
        """Once elected: ``core.group.leader_step`` over the view, whenever the watch changes
        it or a step's own due time comes (a grace, a patience, a backoff)."""
        await self._etcd.campaign(f"{self.prefix}/election", lease, self.host.encode())
        self.leading = True
        self.emit(ev.GroupLeader(group=self.group.name, node_rank=self.group.node_rank))
        loop = asyncio.get_running_loop()
        rules = LeaderRules.of(self.cfg, config_hash=self.config_hash, host=self.host)
        memo = LeaderMemo.start(loop.time(), rules)
        while True:
            self._changed.clear()
            step = leader_step(self.view, loop.time(), memo, rules, jitter_sample=self.rng.random())
            memo = step.memo
            for event in step.events:
                self.emit(event)
            for write in step.writes:
                # Compare-and-swap: written only over the record we decided from (a second
                # writer, a leader that lost its place, loses the race and looks again).
                await self._etcd.put_if(f"{self.prefix}/generation", write.generation.to_json(), write.expect_rev)
            wait = None if step.next_due is None else max(0.0, step.next_due - loop.time())
            with contextlib.suppress(TimeoutError):
                await within(self._changed.wait(), wait)


class HeadProber:
    """A node >= 1's health (the ``Prober`` port): SGLang serves a dummy ``/health`` there that
    always answers 200, so the node is READY once node 0 (the real ``/health``) is READY in
    our generation, as read in etcd. From then on only its own process counts: node 0 leaving
    READY is node 0's to report (a hang of ours hangs node 0's ``/health``), never a hang of
    this node's."""

    def __init__(self, sync: GroupSync, alive: Callable[[], bool], ready: Callable[[], bool]) -> None:
        self._sync = sync
        self._alive = alive
        self._ready = ready

    async def probe(self) -> ProbeOutcome:
        ok = self._alive() and (self._ready() or self._sync.head_ready())
        return ProbeOutcome(ok, None, 0.0, "" if ok else "node 0 is not READY in this generation (read in etcd)")

    async def aclose(self) -> None:
        return None


def node_config_hash(cfg: Config) -> str:
    """What this node's config says about the group (``core.group.config_hash``)."""
    flags = parse_flags(cfg.server.extra_args)
    server = {"model_path": cfg.server.model_path, "tp_size": cfg.server.tp_size, "dp_size": cfg.server.dp_size,
              "hicache_size_gb": cfg.server.hicache_size_gb, "mem_fraction_static": cfg.server.mem_fraction_static}
    return config_hash(server, [f"{k}={v}" for k, v in sorted(flags.items())], cfg.policy.fraction_ladder,
                       cfg.group.nnodes, cfg.group.dist_init_addr)


__all__ = ["GroupSync", "HeadProber", "node_config_hash"]
