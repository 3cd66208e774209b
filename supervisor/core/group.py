"""A multi-node group's decisions (issue 16), pure: which node's death is the root cause, and
what the next generation launches with.

SGLang across nodes (``--nnodes N --node-rank R --dist-init-addr HEAD:PORT``) dies as one:
when one node's process dies, the others lose their peer and die too, each with its own
log. Read alone, each log names a cause, and most of them are the echo: node 0 says "gloo
... Connection reset by peer" (a network error) when node 1 was OOM-killed; node 1 says
"Received sigquit from a child process" when node 0 died. So the reports of one generation
are ranked, not raced:

- a hardware cause (a lost GPU, memory that never freed) outranks
- a memory cause (a CUDA OOM, the KV pool, host memory, headroom), which outranks
- a cause local to that node (a CUDA error, a hang, a bad argument, a killed process), which
  outranks
- an echo: a communication error (NCCL/gloo, a peer reset, a collective timeout) or a log
  whose only finding is that a child or a peer went away.

Among reports of the same rank, the one etcd recorded first (the lowest revision) wins:
host clocks are never compared. The winning diagnosis then goes through the same policy as
a single server's crash, once, for the whole group (``next_generation``).
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from supervisor.core import events as ev
from supervisor.core import policy
from supervisor.core.config import Config, PolicyConfig
from supervisor.core.model import Cause, Diagnosis, Phase, Remedy, State

GROUP_PREFIX = "/sglang-supervisor/groups"
# A node's report of a rank it stopped because the generation had ended: never the cause.
GROUP_STOP = "stopped on the group's order"


class Rank(enum.IntEnum):
    """How strongly a node's report names the group's root cause (higher wins)."""

    ECHO = 0
    LOCAL = 1
    MEMORY = 2
    HARDWARE = 3


HARDWARE = frozenset({Cause.GPU_HW_ERROR, Cause.GPU_MEMORY_STUCK})
MEMORY = frozenset({Cause.CUDA_OOM_RUNTIME, Cause.CUDA_OOM_STARTUP, Cause.KV_POOL_TOO_SMALL, Cause.HOST_OOM,
                    Cause.HEADROOM_LOW})
COMMUNICATION = frozenset({Cause.NCCL_ERROR})
# What a node logs when a peer or a child went away, not why: SGLang's SIGQUIT handlers, a
# torch.distributed/gloo/NCCL peer loss, a collective that never completed.
PEER_LOSS = re.compile(
    r"sigquit from a child|SIGQUIT received|connection reset by peer|connection closed by peer"
    r"|gloo.*(?:read|write) error|gloo.*connection closed|broadcast_pyobj|collective operation timeout"
    r"|NCCL (?:communicator was aborted|error: remote process exited)|socket.*(?:closed|reset)",
    re.IGNORECASE,
)


# The daemon's words for a main process that ended by a signal with nothing else found: SGLang's
# own teardown (it SIGKILLs its tree, itself included, after a SIGQUIT), not a finding.
TEARDOWN = re.compile(r"^main process (?:killed by SIG\w+|exited)", re.IGNORECASE)


def rank_of(diagnosis: Diagnosis) -> Rank:
    """How a node's own diagnosis ranks as the group's root cause (see the module docstring).

    An unrecognised end (``other``) is an echo when the node found nothing of its own: no
    evidence but peer-loss lines and its main process's own teardown. A part of its tree
    that died ("Subprocess scheduler_0 crashed with exit code -9") is its own finding, and so
    is a process killed by a signal after it was ready with no error logged (``killed``)."""
    cause = diagnosis.cause
    if cause in HARDWARE:
        return Rank.HARDWARE
    if cause in MEMORY:
        return Rank.MEMORY
    if diagnosis.killed and GROUP_STOP not in diagnosis.evidence:
        return Rank.LOCAL  # killed by a signal after it was ready, no error logged: its own death
    if cause in COMMUNICATION or GROUP_STOP in diagnosis.evidence:
        return Rank.ECHO
    own = [e for e in diagnosis.evidence if not TEARDOWN.search(e)]
    if cause is Cause.OTHER and all(PEER_LOSS.search(e) for e in own):
        return Rank.ECHO
    return Rank.LOCAL


@dataclass(frozen=True, slots=True)
class Report:
    """One node's report of how its rank of a generation ended, as etcd recorded it."""

    node_rank: int
    generation: int
    diagnosis: Diagnosis
    revision: int  # etcd's create revision of the report: its place in the group's order
    host: str = ""

    @property
    def rank(self) -> Rank:
        return rank_of(self.diagnosis)

    def to_dict(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, "generation": self.generation, "host": self.host,
                "diagnosis": self.diagnosis.to_dict()}


def root_cause(reports: Iterable[Report]) -> Report | None:
    """The report that names the group's root cause: the highest rank, then the earliest
    revision; None without reports."""
    return min(reports, key=lambda r: (-r.rank, r.revision), default=None)


@dataclass(frozen=True, slots=True)
class Generation:
    """One launch of the whole group: every node launches its rank with these managed flags.

    ``number`` counts generations (the first is 1); ``fraction`` None leaves the flag out
    (SGLang's choice). ``ended`` is set when any node's server died (or a node was lost):
    every node stops its rank and reports. ``root_cause`` is the report the leader chose for
    the generation before, ``reason`` the policy's words, ``delay_s`` the backoff before it.
    """

    number: int
    fraction: float | None
    hicache_size_gb: int
    config_hash: str
    leader: str = ""
    reason: str = ""
    delay_s: float = 0.0
    root_cause: Mapping[str, Any] | None = None
    ended: str = ""  # why the generation ended ("" while it runs)
    lost_node: int | None = None  # the node whose lease expired, when that ended it
    gave_up: bool = False
    oom_fractions: tuple[float, ...] = ()
    # Generations in a row that ended without serving stable_after_s (the group's crash
    # streak: a count, so no two hosts' clocks are ever compared); ``stable`` is set once
    # this one served that long.
    failures: int = 0
    stable: bool = False

    def to_json(self) -> bytes:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["oom_fractions"] = list(self.oom_fractions)
        d["root_cause"] = dict(self.root_cause) if self.root_cause is not None else None
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Generation:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("a generation record must be a JSON object")  # noqa: TRY004 - bad data, as json.loads
        return cls(
            number=int(d["number"]),
            fraction=None if d.get("fraction") is None else float(d["fraction"]),
            hicache_size_gb=int(d.get("hicache_size_gb", 0)),
            config_hash=str(d.get("config_hash", "")),
            leader=str(d.get("leader", "")),
            reason=str(d.get("reason", "")),
            delay_s=float(d.get("delay_s", 0.0)),
            root_cause=d.get("root_cause") if isinstance(d.get("root_cause"), dict) else None,
            ended=str(d.get("ended", "")),
            lost_node=int(d["lost_node"]) if isinstance(d.get("lost_node"), int) else None,
            gave_up=bool(d.get("gave_up", False)),
            oom_fractions=tuple(float(x) for x in d.get("oom_fractions", ())),
            failures=int(d.get("failures", 0)),
            stable=bool(d.get("stable", False)),
        )


def first_generation(fraction: float | None, hicache_size_gb: int, config_hash: str, leader: str) -> Generation:
    """The group's first generation: the leader's configured (or learned) flags."""
    return Generation(number=1, fraction=fraction, hicache_size_gb=hicache_size_gb, config_hash=config_hash,
                      leader=leader, reason="the group's first generation")


def next_generation(ended: Generation, reports: Sequence[Report], cfg: PolicyConfig, *, leader: str,
                    jitter_sample: float) -> Generation:
    """What the group launches after ``ended``: the root cause among ``reports`` through the
    single server's policy, once for the whole group (the fraction steps, the backoff grows
    with the streak, a cause a restart cannot fix gives up). Without a report (a node lost
    with its host) it is a plain restart."""
    chosen = root_cause(reports)
    lost = Diagnosis(cause=Cause.OTHER, phase=Phase.SERVING, evidence=(ended.ended or "a node was lost",))
    if ended.lost_node is not None and (chosen is None or chosen.rank is Rank.ECHO):
        # A node that vanished (its daemon or host gone) outranks the echoes of its peers.
        chosen = Report(ended.lost_node, ended.number, lost, 0)
    diagnosis = chosen.diagnosis if chosen is not None else lost
    failures = 1 if ended.stable else ended.failures + 1
    decision = policy.decide(
        cause=diagnosis.cause, remedy=diagnosis.remedy, fraction=ended.fraction,
        hicache_size_gb=ended.hicache_size_gb, oom_fractions=frozenset(ended.oom_fractions),
        crashes_in_window=failures, failures=failures, cfg=cfg, jitter_sample=jitter_sample,
        min_fraction=diagnosis.min_fraction,
    )
    oom = set(ended.oom_fractions)
    if diagnosis.remedy is Remedy.FRACTION_DOWN and ended.fraction is not None:
        oom.add(ended.fraction)
    where = f"node {chosen.node_rank}" if chosen is not None else "the group"
    if diagnosis.killed:
        where += f" (killed by {diagnosis.killed}, no error logged)"
    return Generation(
        number=ended.number + 1,
        fraction=decision.fraction,
        hicache_size_gb=decision.hicache_size_gb,
        config_hash=ended.config_hash,
        leader=leader,
        reason=f"{where}: {decision.reason}",
        delay_s=round(decision.delay_s, 3),
        root_cause={**chosen.to_dict(), "rank": chosen.rank.name.lower()} if chosen is not None else None,
        gave_up=decision.give_up,
        oom_fractions=tuple(sorted(oom, reverse=True)),
        failures=failures,
    )


def restart_refusal(cfg: Config, what: str = "restart") -> str | None:
    """Why ``what`` (an operator's restart, stop or start) of this node alone is refused (None:
    it is not): a node of a group cannot act alone, the group relaunches as one. The daemon
    answers with it; the machine ignores such a request of a group node for the same reason."""
    g = cfg.group
    if not g.enabled:
        return None
    return f"node {g.node_rank} of group {g.name!r} cannot {what} alone: the group relaunches as one (docs/group.md)"


def diagnosis_from_dict(d: Mapping[str, Any]) -> Diagnosis:
    """A report's diagnosis back from its JSON form (``Diagnosis.to_dict``): an unknown cause
    is ``other``; a remedy other than the cause's own is kept as the override."""
    try:
        cause = Cause.parse(str(d.get("cause")))
    except ValueError:
        cause = Cause.OTHER
    try:
        phase = Phase(str(d.get("phase")))
    except ValueError:
        phase = Phase.SERVING
    remedy = d.get("remedy")
    override = Remedy(remedy) if remedy in {r.value for r in Remedy} and remedy != cause.remedy.value else None
    evidence = d.get("evidence") or ()
    return Diagnosis(
        cause=cause, phase=phase,
        evidence=tuple(str(e) for e in (evidence if isinstance(evidence, list | tuple) else [evidence])),
        location=d.get("location") if isinstance(d.get("location"), str) else None,
        remedy_override=override,
        min_fraction=float(d["min_fraction"]) if isinstance(d.get("min_fraction"), int | float) else None,
        certain=bool(d.get("certain", True)),
        basis=str(d.get("basis") or ""),
        unrecognised=d.get("unrecognised") if isinstance(d.get("unrecognised"), str) else None,
        killed=d.get("killed") if isinstance(d.get("killed"), str) else None,
    )


# The flags every node must agree on: they shape the group's memory and its rendezvous.
# Anything else (a log level, an API key) may differ between nodes.
GROUP_RELEVANT_KEYS = ("model_path", "tp_size", "dp_size", "hicache_size_gb", "mem_fraction_static")


def config_hash(server: Mapping[str, Any], memory_flags: Sequence[str], ladder: Sequence[float],
                nnodes: int, dist_init_addr: str) -> str:
    """A short hash of what a node's config says about the group: the group-relevant
    ``[server]`` keys, the memory flags of its ``extra_args`` (normalised by the caller), the
    ladder, the group's size and rendezvous. Nodes whose hashes differ refuse to join."""
    identity = {
        "server": {k: server.get(k) for k in GROUP_RELEVANT_KEYS},
        "flags": list(memory_flags),
        "ladder": list(ladder),
        "nnodes": nnodes,
        "dist_init_addr": dist_init_addr,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


# -- the leader --------------------------------------------------------------------------------
#
# One node leads (etcd's election); its decisions are ``leader_step``: a function of what etcd
# holds (``GroupView``), the time, and what the leader remembers (``LeaderMemo``). It returns
# the generation records to write (compare-and-swap over the revision it decided from), the
# events to log, and when it must look again if nothing in etcd changes (``next_due``): the
# shell waits for the watch or that time, never on a fixed tick, and never sleeps inside a
# decision (the backoff is a due write).


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node's key (``nodes/<rank>``) as the group sees it."""

    rank: int
    state: str
    generation: int
    config_hash: str
    host: str = ""
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class GroupView:
    """The group's records in etcd, as the node's watch keeps them."""

    generation: Generation | None = None
    generation_rev: int = 0  # its mod revision (0: absent), for compare-and-swap
    nodes: Mapping[int, NodeInfo] = field(default_factory=dict)
    reports: Mapping[int, Mapping[int, Report]] = field(default_factory=dict)  # generation -> node -> report


@dataclass(frozen=True, slots=True)
class LeaderRules:
    """What the leader's decisions read from the config."""

    group: str
    nnodes: int
    lease_ttl_s: float
    stop_grace_s: float
    stable_after_s: float
    policy: PolicyConfig
    config_hash: str
    host: str
    fraction: float | None
    hicache_size_gb: int

    @classmethod
    def of(cls, cfg: Config, *, config_hash: str, host: str) -> LeaderRules:
        return cls(group=cfg.group.name, nnodes=cfg.group.nnodes, lease_ttl_s=cfg.group.lease_ttl_s,
                   stop_grace_s=cfg.server.stop_grace_s, stable_after_s=cfg.policy.stable_after_s, policy=cfg.policy,
                   config_hash=config_hash, host=host, fraction=cfg.server.mem_fraction_static,
                   hicache_size_gb=cfg.server.hicache_size_gb)

    @property
    def patience_s(self) -> float:
        """How long an ended generation waits for every running node's report: its stop
        grace, a lease TTL for a node about to vanish, and 5 s for the write to land."""
        return self.stop_grace_s + self.lease_ttl_s + 5.0


@dataclass(frozen=True, slots=True)
class GenerationWrite:
    """Write ``generation`` if the record is still at ``expect_rev`` (0: absent), at ``due``."""

    generation: Generation
    expect_rev: int
    due: float = 0.0


@dataclass(frozen=True, slots=True)
class LeaderMemo:
    """What a leader remembers between its steps; a new leader starts afresh (``start``)."""

    grace_until: float  # a node absent before this is not lost yet (a new leader's grace)
    running_since: Mapping[int, float] = field(default_factory=dict)  # generation -> first seen running
    ready_since: Mapping[int, float] = field(default_factory=dict)  # generation -> first seen READY on node 0
    ended_seen: Mapping[int, float] = field(default_factory=dict)  # generation -> first seen ended
    pending: GenerationWrite | None = None  # the next generation, waiting out its backoff
    acted_on: int | None = None  # the record's revision the leader last wrote over

    @classmethod
    def start(cls, now: float, rules: LeaderRules) -> LeaderMemo:
        """Nodes get one lease TTL to register after a new leader (or etcd) comes back."""
        return cls(grace_until=now + rules.lease_ttl_s)


@dataclass(frozen=True, slots=True)
class LeaderStep:
    memo: LeaderMemo
    writes: tuple[GenerationWrite, ...] = ()
    events: tuple[ev.Event, ...] = ()
    next_due: float | None = None  # look again then, if etcd has not changed before


def _first(*dues: float | None) -> float | None:
    known = [d for d in dues if d is not None]
    return min(known) if known else None


def _write(memo: LeaderMemo, gen: Generation, expect_rev: int, *events: ev.Event) -> LeaderStep:
    """Write ``gen`` over ``expect_rev`` now; decide nothing more until the record has moved."""
    return LeaderStep(replace(memo, pending=None, acted_on=expect_rev), (GenerationWrite(gen, expect_rev),), events)


def leader_step(view: GroupView, now: float, memo: LeaderMemo, rules: LeaderRules, *,
                jitter_sample: float) -> LeaderStep:
    """The leader's decision over the group's records (the module docstring; docs/group.md):

    - no generation yet: the first, once every node registered with the same config;
    - a generation running: it ends at its first report, or when a node is missing one lease
      TTL after the generation started (and after the leader's own grace); node 0 READY for
      ``stable_after_s`` marks it stable;
    - a generation ended: once every node still running it has reported (or ``patience_s``
      passed), the next generation from the root cause, written when its backoff is due.
    """
    if memo.acted_on is not None and view.generation_rev == memo.acted_on:
        return LeaderStep(memo)  # our write is on its way back through the watch
    memo = replace(memo, acted_on=None)
    gen = view.generation
    if gen is None:
        everyone = len(view.nodes) == rules.nnodes and all(
            n.config_hash == rules.config_hash for n in view.nodes.values())
        if everyone:
            first = first_generation(rules.fraction, rules.hicache_size_gb, rules.config_hash, rules.host)
            return _write(memo, first, 0)
        return LeaderStep(memo)
    pending = memo.pending
    if pending is not None:
        if pending.expect_rev != view.generation_rev:
            memo = replace(memo, pending=None)  # another writer moved the record: decide afresh
        elif now >= pending.due:
            return _write(memo, pending.generation, pending.expect_rev)
        else:
            return LeaderStep(memo, next_due=pending.due)
    if gen.gave_up:
        return LeaderStep(memo)
    if not gen.ended:
        return _running(view, gen, now, memo, rules)
    return _ended(view, gen, now, memo, rules, jitter_sample)


def _running(view: GroupView, gen: Generation, now: float, memo: LeaderMemo, rules: LeaderRules) -> LeaderStep:
    reports = view.reports.get(gen.number, {})
    started = memo.running_since.get(gen.number, now)
    memo = replace(memo, running_since={**memo.running_since, gen.number: started})
    why, lost_node, due = "", None, None
    if reports:
        first = min(reports.values(), key=lambda r: r.revision)
        why = f"node {first.node_rank}: {first.diagnosis.cause}"
    else:
        lost = [r for r in range(rules.nnodes) if r not in view.nodes]
        # A node absent when a generation starts (its daemon being restarted) gets one lease
        # TTL to join it before it is lost, as every node does when a leader starts.
        deadline = max(memo.grace_until, started + rules.lease_ttl_s)
        if lost and now >= deadline:
            lost_node = lost[0]
            why = f"node {lost_node} lost: its lease expired (its daemon or its host is gone)"
        elif lost:
            due = deadline
    if why:
        return _write(memo, replace(gen, ended=why, lost_node=lost_node), view.generation_rev,
                      ev.GroupGenerationEnded(group=rules.group, number=gen.number, reason=why))
    head = view.nodes.get(0)
    if head is not None and head.state == str(State.READY) and head.generation == gen.number and not gen.stable:
        since = memo.ready_since.get(gen.number, now)
        memo = replace(memo, ready_since={**memo.ready_since, gen.number: since})
        if now - since >= rules.stable_after_s:
            return _write(memo, replace(gen, stable=True), view.generation_rev)
        due = _first(due, since + rules.stable_after_s)
    return LeaderStep(memo, next_due=due)


def _ended(view: GroupView, gen: Generation, now: float, memo: LeaderMemo, rules: LeaderRules,
           jitter_sample: float) -> LeaderStep:
    seen = memo.ended_seen.get(gen.number, now)
    memo = replace(memo, ended_seen={**memo.ended_seen, gen.number: seen})
    reports = view.reports.get(gen.number, {})
    waiting_for = [r for r, n in view.nodes.items() if r not in reports and n.generation == gen.number
                   and n.state not in (str(State.WAITING), str(State.GAVE_UP))]
    if waiting_for and now - seen < rules.patience_s:
        return LeaderStep(memo, next_due=seen + rules.patience_s)  # the others are still stopping their ranks
    parsed = list(reports.values())
    nxt = next_generation(gen, parsed, rules.policy, leader=rules.host, jitter_sample=jitter_sample)
    root = nxt.root_cause or {}
    decided = ev.GroupGeneration(
        group=rules.group, number=nxt.number, mem_fraction_static=nxt.fraction,
        hicache_size_gb=nxt.hicache_size_gb, reason=nxt.reason, delay_s=nxt.delay_s, gave_up=nxt.gave_up,
        root_node=root.get("node_rank"),
        root_cause=diagnosis_from_dict(root.get("diagnosis") or {}).cause if root else None,
        reports=tuple({"node": r.node_rank, "cause": str(r.diagnosis.cause), "rank": r.rank.name.lower(),
                       "revision": r.revision} for r in sorted(parsed, key=lambda r: r.revision)),
    )
    if nxt.delay_s > 0:  # one backoff for the whole group: the write is due after it
        due = now + nxt.delay_s
        return LeaderStep(replace(memo, pending=GenerationWrite(nxt, view.generation_rev, due)), (),
                          (decided,), due)
    return _write(memo, nxt, view.generation_rev, decided)
