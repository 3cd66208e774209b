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
