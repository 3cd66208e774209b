"""Which servers share a fleet-memory record (issue 16): the record's etcd key.

Two servers share what they learned about memory (the rung, the fractions that OOMed) only
if everything that decides their memory use is the same: the model, the SGLang version, the
GPU and its memory, the parallel layout, and the flags that size the KV cache, the CUDA
graphs, the draft model and the host cache. Anything else (``--log-level``, the port, an
API key) must not split the fleet, so only the listed flags are read from ``extra_args``.

The key is readable where an operator lists records (model, version, GPU, layout) and ends
in a short hash of the whole identity, so two configurations that differ only in a flag get
different keys. The function is pure: the caller reads the version and the GPU.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from supervisor.core.capacity import MemoryPoint, merge_points

FLEET_PREFIX = "/sglang-supervisor/fleet"
HASH_CHARS = 12  # 48 bits: no accidental collision among a fleet's few hundred configurations
SLUG_CHARS = 64

# SGLang's launch_server flags that change how much GPU memory a server needs, with their
# aliases. Managed flags (fraction, host cache size, tp, dp) come in as arguments instead.
MEMORY_FLAGS: dict[str, str] = {
    "--quantization": "quantization",
    "--kv-cache-dtype": "kv-cache-dtype",
    "--dtype": "dtype",
    "--context-length": "context-length",
    "--max-running-requests": "max-running-requests",
    "--max-total-tokens": "max-total-tokens",
    "--chunked-prefill-size": "chunked-prefill-size",
    "--cuda-graph-bs": "cuda-graph-bs",
    "--cuda-graph-max-bs": "cuda-graph-max-bs",
    "--disable-cuda-graph": "disable-cuda-graph",
    "--speculative-algorithm": "speculative-algorithm",
    "--speculative-draft-model-path": "speculative-draft-model-path",
    "--speculative-num-steps": "speculative-num-steps",
    "--speculative-eagle-topk": "speculative-eagle-topk",
    "--speculative-num-draft-tokens": "speculative-num-draft-tokens",
    "--attention-backend": "attention-backend",
    "--enable-dp-attention": "enable-dp-attention",
    "--hicache-ratio": "hicache-ratio",
}
# Parallel layout flags that may sit in extra_args (tp and dp are [server] keys).
LAYOUT_FLAGS: dict[str, str] = {
    "--pp-size": "pp",
    "--pipeline-parallel-size": "pp",
    "--ep-size": "ep",
    "--expert-parallel-size": "ep",
    "--nnodes": "nnodes",
}
_KNOWN = {**MEMORY_FLAGS, **LAYOUT_FLAGS}
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class FleetIdentity:
    """Everything that decides a server's memory use; equal identities share a record."""

    model: str
    sglang_version: str
    gpu_name: str
    gpu_memory_mib: int
    tp: int
    dp: int
    pp: int
    ep: int
    nnodes: int
    hicache_size_gb: int
    flags: tuple[tuple[str, str], ...]  # (name, canonical value), sorted by name


def parse_flags(extra_args: Sequence[str]) -> dict[str, str]:
    """The memory-relevant and layout flags in ``extra_args``, by canonical name.

    Reads ``--flag value``, ``--flag=value``, a bare switch (``"true"``), several values
    (``--cuda-graph-bs 1 2 4``, kept sorted) and argparse's unambiguous abbreviations
    (``--context-len``). As with argparse, the last occurrence wins."""
    found: dict[str, str] = {}
    i = 0
    while i < len(extra_args):
        arg = extra_args[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            continue
        name, eq, inline = arg.partition("=")
        values = [inline] if eq else []
        while not eq and i < len(extra_args) and not extra_args[i].startswith("--"):
            values.append(extra_args[i])
            i += 1
        canonical = _canonical_flag(name)
        if canonical is not None:
            found[canonical] = _canonical_value(canonical, values)
    return found


def _canonical_flag(name: str) -> str | None:
    if name in _KNOWN:
        return _KNOWN[name]
    matches = {flag for known, flag in _KNOWN.items() if known.startswith(name)}
    return matches.pop() if len(matches) == 1 else None


def _canonical_value(flag: str, values: list[str]) -> str:
    if not values:
        return "true"
    if flag == "cuda-graph-bs":  # a set of batch sizes: their order is no difference
        return " ".join(sorted(values, key=lambda v: (len(v), v)))
    return " ".join(values)


def fleet_identity(
    *,
    model: str,
    sglang_version: str,
    gpu_name: str,
    gpu_memory_bytes: int,
    tp: int,
    dp: int,
    extra_args: Sequence[str] = (),
    hicache_size_gb: int = 0,
    pp: int | None = None,
    ep: int | None = None,
    nnodes: int | None = None,
) -> FleetIdentity:
    """The identity of a configuration. ``hicache_size_gb`` is the configured host cache (the
    ``[server]`` key), not the learned one: the ladder moving must not move the record. pp,
    ep and nnodes default to what ``extra_args`` says, else 1."""
    flags = parse_flags(extra_args)

    def layout(name: str, given: int | None) -> int:
        if given is not None:
            return given
        text = flags.get(name, "1")
        return int(text) if text.isdigit() else 1

    memory = tuple(sorted((k, v) for k, v in flags.items() if k not in LAYOUT_FLAGS.values()))
    return FleetIdentity(
        model=model.rstrip("/") or model,
        sglang_version=sglang_version.strip(),
        gpu_name=" ".join(gpu_name.split()),
        gpu_memory_mib=gpu_memory_bytes // (1024 * 1024),
        tp=tp, dp=dp, pp=layout("pp", pp), ep=layout("ep", ep), nnodes=layout("nnodes", nnodes),
        hicache_size_gb=hicache_size_gb,
        flags=memory,
    )


def fleet_key(identity: FleetIdentity, prefix: str = FLEET_PREFIX) -> str:
    """``<prefix>/<model>/<sglang version>/<gpu>-<MiB>MiB/tp..-dp..-pp..-ep..-n../<hash>``:
    the readable parts for ``fleet list``, the hash over the whole identity (flags too)."""
    digest = hashlib.sha256(json.dumps(asdict(identity), sort_keys=True).encode()).hexdigest()[:HASH_CHARS]
    i = identity
    parts = [
        _slug(i.model),
        _slug(i.sglang_version),
        f"{_slug(i.gpu_name)}-{i.gpu_memory_mib}MiB",
        f"tp{i.tp}-dp{i.dp}-pp{i.pp}-ep{i.ep}-n{i.nnodes}",
        digest,
    ]
    return "/".join([prefix.rstrip("/"), *parts])


def _slug(text: str) -> str:
    """``text`` as one readable path segment: runs of other characters become ``_``."""
    slug = _UNSAFE.sub("_", text).strip("_.") or "unknown"
    return slug[-SLUG_CHARS:] if len(slug) > SLUG_CHARS else slug


# --- the record ------------------------------------------------------------------------------

RECORD_VERSION = 1
RECORD_OOMS = 100  # the newest OOMs kept in a record; the rung is kept whatever is dropped


@dataclass(frozen=True, slots=True)
class FleetOom:
    """One step down the ladder somewhere in the fleet: the fraction that ran out of memory,
    the rung it led to (None: the server gave up there), when (wall time, RFC 3339) and where.

    The daemon's core makes these with ``host`` empty and ``key`` the fleet key of the launch
    that crashed (empty if it was not known); the shell fills ``host`` when it writes them."""

    fraction: float
    next_fraction: float | None
    when: str
    cause: str
    server: str
    config: str
    host: str = ""
    key: str = ""

    @property
    def reached(self) -> float:
        """The fraction the fleet reached through this step."""
        return self.fraction if self.next_fraction is None else self.next_fraction

    @property
    def identity(self) -> tuple[float, str, str, str, str]:
        """What makes two entries the same OOM (a write retried after an unseen success)."""
        return (self.fraction, self.when, self.host, self.server, self.config)

    def to_dict(self) -> dict[str, object]:
        return {"fraction": self.fraction, "next_fraction": self.next_fraction, "when": self.when,
                "cause": self.cause, "host": self.host, "server": self.server, "config": self.config}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> FleetOom:
        nxt = d.get("next_fraction")
        return cls(
            fraction=float(d["fraction"]),  # type: ignore[arg-type]
            next_fraction=None if nxt is None else float(nxt),  # type: ignore[arg-type]
            when=str(d.get("when", "")), cause=str(d.get("cause", "")), server=str(d.get("server", "")),
            config=str(d.get("config", "")), host=str(d.get("host", "")), key=str(d.get("key", "")),
        )


@dataclass(frozen=True, slots=True)
class FleetRecord:
    """The JSON at a fleet key: the lowest fraction the fleet reached (``rung``) and the OOMs
    that led there, oldest first; the memory model's points (``core.capacity``: start-up
    facts and serving peaks per fraction) and the highest fraction a climb kept past its
    probation (``kept``: None once a fraction at or below it ran out of memory)."""

    key: str
    rung: float | None
    ooms: tuple[FleetOom, ...] = ()
    updated: str = ""
    points: tuple[MemoryPoint, ...] = ()
    kept: float | None = None

    @property
    def oom_fractions(self) -> frozenset[float]:
        return frozenset(o.fraction for o in self.ooms)

    def lowest(self) -> FleetOom | None:
        """The OOM that took the fleet to its rung (the newest of those)."""
        at = [o for o in self.ooms if o.reached == self.rung]
        return at[-1] if at else None

    def to_json(self) -> bytes:
        return json.dumps({
            "version": RECORD_VERSION, "key": self.key, "rung": self.rung,
            "ooms": [o.to_dict() for o in self.ooms], "updated": self.updated,
            "points": [p.to_dict() for p in self.points], "kept": self.kept,
        }, sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> FleetRecord:
        """The record stored at ``key``; ``ValueError`` for anything else (not JSON, not ours)."""
        try:
            d = json.loads(raw)
            rung = d.get("rung")
            ooms = tuple(FleetOom.from_dict(o) for o in d.get("ooms", []))
            points = tuple(MemoryPoint.from_dict(p) for p in d.get("points", []))
            kept = d.get("kept")
            return cls(key=key, rung=None if rung is None else float(rung), ooms=ooms,
                       updated=str(d.get("updated", "")), points=points, kept=None if kept is None else float(kept))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{key}: not a fleet record ({type(exc).__name__})") from None


def merge(record: FleetRecord | None, key: str, ooms: Sequence[FleetOom], now: str,
          points: Sequence[MemoryPoint] = (), kept: float | None = None) -> FleetRecord:
    """``record`` with ``ooms`` added (an OOM it holds already is not added twice); the rung
    only ever goes down. ``points`` join the record's (``capacity.merge_points``: the
    writer's start-up facts, the lower least free memory per rank); ``kept`` only ever goes
    up, and is forgotten once the record holds an OOM at or below it. ``record`` None: a
    new record."""
    kept_ooms = list(record.ooms) if record else []
    seen = {o.identity for o in kept_ooms}
    rung = record.rung if record else None
    for oom in ooms:
        rung = oom.reached if rung is None else min(rung, oom.reached)
        if oom.identity not in seen:
            seen.add(oom.identity)
            kept_ooms.append(FleetOom(oom.fraction, oom.next_fraction, oom.when, oom.cause, oom.server, oom.config,
                                 oom.host, ""))
    highest = max((k for k in (record.kept if record else None, kept) if k is not None), default=None)
    if highest is not None and any(o.fraction <= highest + 1e-9 for o in kept_ooms):
        highest = None
    return FleetRecord(key=key, rung=rung, ooms=tuple(kept_ooms[-RECORD_OOMS:]), updated=now,
                       points=merge_points(record.points if record else (), points), kept=highest)
