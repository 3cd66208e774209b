"""The highest stable fraction: a memory model learned from every launch, and what it
recommends (docs/capacity.md).

Pure. For one model, SGLang version, GPU, layout and memory flags (the model's ``key``),
what a launch at fraction ``f`` leaves is linear in ``f``:

- ``tokens(f) = a + b·f``: the KV pool is ``f × total − weights − …``, in tokens;
- ``avail_r(f) = c_r − d_r·f``: the memory rank ``r`` has left after CUDA-graph capture
  (SGLang's "avail mem" on its "Capture cuda graph end" line).

Two launches at different fractions determine both lines; more refine them (least
squares). While serving, NVML's free memory per rank falls below ``avail_r`` by what the
forward passes take at their peak (PyTorch's caching allocator keeps what it reserved):
``transient_r = avail_r(f₀) − least_free_r(f₀)``, the largest seen at any fraction. The
headroom a fraction would leave at that peak is ``avail_r(f) − transient_r``; the
recommended fraction ``f*`` is the highest step of ``climb_step`` whose headroom on the
tightest rank stays at or above ``headroom_min_gb + climb_margin_gb``, never above the
ceiling nor at or above a fraction that ran out of memory.

A model also keeps ``kept``: the highest fraction a climb reached and kept past its
probation. With ``[fleet]`` on, the points and ``kept`` are shared under the fleet key
(``merge_points``, ``MemoryModel.joined``): a server learns from launches it never made.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from supervisor.core.diagnosis.startup_facts import MAIN_RANK  # lines without a rank (a TP-1 server's)
from supervisor.core.model import StartupFacts

STALE_TOKENS_SHARE = 0.05  # a launch whose tokens the model mispredicts by more: a new model
STALE_AVAIL_GB = 1.0  # or whose headroom it mispredicts by more (an upgrade the key missed)
PEAK_STEP_GB = 0.05  # a new least-free reading counts when it is this much lower
POINTS_KEPT = 8  # the most recent fractions kept per model

METRICS_FLAG = "--enable-metrics"  # SGLang serves its /metrics (sglang:token_usage, ...) with it

# The TP part of a rank name: "TP3", "DP1 TP3" (SGLang's log prefix), "DP1-TP3", "TP3_EP3".
_TP_RANK = re.compile(r"(?:^|[\s_-])TP(\d{1,5})(?=$|[\s_-])")


def rank_gpus(ranks: Iterable[str]) -> dict[str, int]:
    """Each rank's GPU as its 0-based position among the GPUs the server sees.

    TP rank i runs on the i-th GPU (SGLang's default ``--base-gpu-id 0 --gpu-id-step 1``);
    on one node of a multi-node server, on the i-th after the node's lowest TP rank. Only
    ranks that cannot be mistaken are mapped: a TP number reported by exactly one rank
    (with DP attention TP ranks are global, so "DP1 TP3" is GPU 3), and ``main`` when it is
    the only rank (a TP-1 server prints no rank). Plain data parallelism and pipeline
    stages repeat TP numbers ("DP0 TP0", "DP1 TP0"): those ranks, and ranks without a TP
    part, are left out rather than guessed.
    """
    names = list(ranks)
    tp = {name: int(m.group(1)) for name in names if (m := _TP_RANK.search(name))}
    if not tp:
        return {MAIN_RANK: 0} if names == [MAIN_RANK] else {}
    numbers = list(tp.values())
    first = min(numbers)
    return {name: n - first for name, n in tp.items() if numbers.count(n) == 1}


def left_after_start(facts: StartupFacts) -> dict[str, float]:
    """Per rank, the memory a finished start left: after CUDA-graph capture, or, where no
    graphs were captured (``--disable-cuda-graph``, the CPU), after the KV pool once the
    server is ready. Empty while a start is still under way or a rank's figure is missing."""
    ranks = facts.ranks.values()
    if all(r.avail_mem_after_capture_gb is not None for r in ranks):
        return {r.rank: r.avail_mem_after_capture_gb for r in ranks if r.avail_mem_after_capture_gb is not None}
    if facts.ready and all(r.avail_mem_after_capture_gb is None and r.avail_mem_after_pool_gb is not None
                           for r in ranks):
        return {r.rank: r.avail_mem_after_pool_gb for r in ranks if r.avail_mem_after_pool_gb is not None}
    return {}


@dataclass(frozen=True, slots=True)
class MemoryPoint:
    """What one launch at ``fraction`` showed: its KV tokens and, per rank, the memory left
    after CUDA-graph capture and the least free memory seen while it served."""

    fraction: float
    kv_tokens: int
    avail_gb: Mapping[str, float]
    least_free_gb: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "kv_tokens": self.kv_tokens, "avail_gb": dict(self.avail_gb),
                "least_free_gb": dict(self.least_free_gb)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryPoint:
        return cls(
            fraction=float(d["fraction"]), kv_tokens=int(d["kv_tokens"]),
            avail_gb={str(k): float(v) for k, v in dict(d["avail_gb"]).items()},
            least_free_gb={str(k): float(v) for k, v in dict(d.get("least_free_gb", {})).items()},
        )


@dataclass(frozen=True, slots=True)
class Line:
    """``y = intercept + slope·x``, least squares over at least two distinct x."""

    intercept: float
    slope: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x

    @classmethod
    def fit(cls, xy: Iterable[tuple[float, float]]) -> Line | None:
        pairs = list(xy)
        if len({round(x, 6) for x, _ in pairs}) < 2:
            return None
        n = len(pairs)
        mx = sum(x for x, _ in pairs) / n
        my = sum(y for _, y in pairs) / n
        sxx = sum((x - mx) ** 2 for x, _ in pairs)
        slope = sum((x - mx) * (y - my) for x, y in pairs) / sxx
        return cls(my - slope * mx, slope)


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """The points of one key, one per fraction (the latest launch there wins, and keeps
    the least free memory seen at that fraction)."""

    key: str = ""
    points: tuple[MemoryPoint, ...] = ()
    kept: float | None = None  # the highest fraction a climb kept past its probation

    def point(self, fraction: float) -> MemoryPoint | None:
        return next((p for p in self.points if math.isclose(p.fraction, fraction, abs_tol=1e-6)), None)

    def launched(self, key: str, fraction: float, facts: StartupFacts) -> MemoryModel:
        """With a launch's start-up facts (unchanged when they are incomplete). A new key,
        or facts the model mispredicts (an upgrade the key did not name), start afresh."""
        avail = left_after_start(facts)
        tokens = facts.kv_cache_tokens or facts.max_total_num_tokens
        if not avail or tokens is None:
            return self
        model = self if key == self.key else MemoryModel(key)
        if model.mispredicts(fraction, tokens, avail):
            # the facts here disagree with the model (an upgrade the key did not name): the
            # old points and the fraction kept on them are no evidence any more
            model = MemoryModel(key)
        old = model.point(fraction)
        kept = old.least_free_gb if old is not None and set(old.avail_gb) == set(avail) else {}
        new = MemoryPoint(fraction, tokens, avail, kept)
        others = tuple(p for p in model.points if p is not old)
        return replace(model, points=(*others, new)[-POINTS_KEPT:])

    def joined(self, key: str, points: Iterable[MemoryPoint], kept: float | None = None) -> MemoryModel:
        """With what other servers of the same ``key`` learned (the fleet's record): their
        fractions this model lacks, unless it mispredicts them (they disagree with what was
        seen here); at a fraction both know, this model's facts and the lower peak per
        rank. ``kept``: the higher of the two. A model of another key is replaced."""
        model = self if key == self.key else MemoryModel(key)
        theirs = tuple(p for p in points if model.point(p.fraction) is not None
                       or not model.mispredicts(p.fraction, p.kv_tokens, p.avail_gb))
        merged = merge_points(theirs, model.points)
        highest = max((k for k in (model.kept, kept) if k is not None), default=None)
        return replace(model, points=merged, kept=highest)

    def mispredicts(self, fraction: float, tokens: int, avail: Mapping[str, float]) -> bool:
        line = self.tokens_line()
        if line is not None and abs(line.at(fraction) - tokens) > STALE_TOKENS_SHARE * max(tokens, 1):
            return True
        for rank, value in avail.items():
            fit = self.avail_line(rank)
            if fit is not None and abs(fit.at(fraction) - value) > STALE_AVAIL_GB:
                return True
        return False

    def served(self, fraction: float, least_free: Mapping[str, float]) -> MemoryModel:
        """With the least free memory per rank seen while serving at ``fraction``; itself
        when nothing is lower by ``PEAK_STEP_GB`` (or no launch at that fraction is known)."""
        old = self.point(fraction)
        if old is None:
            return self
        merged = dict(old.least_free_gb)
        for rank, free in least_free.items():
            if rank in old.avail_gb and free < merged.get(rank, math.inf) - PEAK_STEP_GB:
                merged[rank] = round(free, 3)
        if merged == dict(old.least_free_gb):
            return self
        new = replace(old, least_free_gb=merged)
        return replace(self, points=tuple(new if p is old else p for p in self.points))

    def tokens_line(self) -> Line | None:
        return Line.fit((p.fraction, p.kv_tokens) for p in self.points)

    def avail_line(self, rank: str) -> Line | None:
        return Line.fit((p.fraction, p.avail_gb[rank]) for p in self.points if rank in p.avail_gb)

    def ranks(self) -> list[str]:
        return sorted({r for p in self.points for r in p.avail_gb})

    def transient_gb(self, rank: str) -> float | None:
        """What the forward passes took at their peak on ``rank``, the most seen anywhere."""
        seen = [p.avail_gb[rank] - p.least_free_gb[rank] for p in self.points
                if rank in p.least_free_gb and rank in p.avail_gb]
        return max(0.0, *seen) if seen else None

    def climb_kept(self, fraction: float) -> MemoryModel:
        """A climb to ``fraction`` passed its probation."""
        if self.kept is not None and self.kept >= fraction:
            return self
        return replace(self, kept=fraction)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "points": [p.to_dict() for p in self.points]}
        if self.kept is not None:
            d["kept"] = self.kept
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryModel:
        kept = d.get("kept")
        return cls(str(d.get("key", "")), tuple(MemoryPoint.from_dict(p) for p in d.get("points", [])),
                   None if kept is None else float(kept))


def merge_points(base: Iterable[MemoryPoint], newer: Iterable[MemoryPoint]) -> tuple[MemoryPoint, ...]:
    """One point per fraction from two lists of the same key: at a fraction both have, the
    newer list's start-up facts and, per rank, the lower of the two serving peaks' least free
    memory (the highest peak anyone saw); the newer list's points last, the oldest dropped
    past ``POINTS_KEPT``."""
    old_points, new = list(base), list(newer)

    def at(points: list[MemoryPoint], fraction: float) -> MemoryPoint | None:
        return next((p for p in points if math.isclose(p.fraction, fraction, abs_tol=1e-6)), None)

    out = [b for b in old_points if at(new, b.fraction) is None]
    for p in new:
        same = at(old_points, p.fraction)
        if same is not None and set(same.avail_gb) == set(p.avail_gb):
            least = dict(p.least_free_gb)
            for rank, free in same.least_free_gb.items():
                least[rank] = min(free, least.get(rank, math.inf))
            p = replace(p, least_free_gb=least)
        out.append(p)
    return tuple(out[-POINTS_KEPT:])


@dataclass(frozen=True, slots=True)
class Recommendation:
    """``fraction`` (f*) with its arithmetic, or ``missing``: what the model still lacks."""

    current: float | None
    fraction: float | None = None
    missing: str = ""
    kv_tokens_now: int | None = None
    kv_tokens_at: int | None = None
    headroom_gb: float | None = None  # predicted at f*, at the observed peak, on ``rank``
    rank: str = ""
    limit: str = ""  # what stops f* from being higher: "headroom", "ceiling", "out of memory at 0.93"

    @property
    def gain(self) -> float | None:
        """The KV tokens f* gives over the current fraction, as a share (0.19: +19 %)."""
        if self.kv_tokens_now and self.kv_tokens_at is not None:
            return self.kv_tokens_at / self.kv_tokens_now - 1
        return None

    def higher(self) -> bool:
        """f* is above the current fraction: a climb would pay."""
        return self.fraction is not None and self.current is not None and self.fraction > self.current + 1e-9

    def words(self) -> str:
        if self.fraction is None:
            return f"no recommended fraction yet: {self.missing}"
        gain = self.gain
        tokens = "" if gain is None else f" would give {gain * 100:+.0f} % KV tokens ({self.kv_tokens_at:,}) and"
        now = "" if self.current is None else f" (now {self.current:g})"
        return (f"{self.fraction:g}{now}{tokens} leave {self.headroom_gb:.1f} GB at the observed peak on the"
                f" tightest rank ({self.rank}); {self.limit} stops it higher")


def recommend(
    model: MemoryModel, *, current: float | None, floor_gb: float, step: float, ceiling: float,
    out_of_memory: Iterable[float] = (),
) -> Recommendation:
    """f*: the highest step whose predicted headroom at the observed peak stays at or above
    ``floor_gb`` on every rank, at most ``ceiling`` and below every fraction in
    ``out_of_memory`` (see the module docstring)."""
    fractions = sorted({p.fraction for p in model.points})
    if len(fractions) < 2:
        has = f"has {fractions[0]:g} only" if fractions else "has none"
        return Recommendation(current, missing=f"needs start-up facts from launches at two different fractions ({has})")
    ranks = model.ranks()
    lines = {r: model.avail_line(r) for r in ranks}
    transient = {r: model.transient_gb(r) for r in ranks}
    if any(t is None for t in transient.values()):
        return Recommendation(current, missing="needs the least free GPU memory seen while serving (no load seen yet)")
    tokens = model.tokens_line()
    assert tokens is not None
    oom = sorted(f for f in out_of_memory if f > 0)
    top, limit = ceiling, "the ceiling"
    if oom and oom[0] - step < top + 1e-9:
        top, limit = oom[0] - step, f"the out-of-memory at {oom[0]:g}"
    k = math.floor(top / step + 1e-6)

    def headroom(f: float) -> tuple[float, str]:
        return min(((line.at(f) - (transient[r] or 0.0)) if line else math.inf, r) for r, line in lines.items())

    while k > 0:
        f = round(k * step, 6)
        room, rank = headroom(f)
        if room >= floor_gb - 1e-9:
            now = model.point(current) if current is not None else None
            tokens_now = now.kv_tokens if now is not None else (round(tokens.at(current)) if current else None)
            if k < math.floor(top / step + 1e-6):
                limit = "the headroom"
            return Recommendation(
                current, fraction=f, kv_tokens_now=tokens_now, kv_tokens_at=max(0, round(tokens.at(f))),
                headroom_gb=round(room, 2), rank=rank, limit=limit,
            )
        k -= 1
    return Recommendation(current, missing=f"no fraction leaves {floor_gb:g} GB at the observed peak")
