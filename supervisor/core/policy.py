"""The restart policy: pure functions of (learned memory, cause, now, config).

- backoff: exponential with jitter and a cap, like Kubernetes' CrashLoopBackOff;
- the fraction ladder: down on a CUDA OOM, up on a startup KV-pool failure (never to a
  fraction that already ran out of CUDA memory), hierarchical cache halved on host OOM;
- give up when a restart cannot help or the crash budget of the window is spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from supervisor.core.backoff import exponential_backoff
from supervisor.core.config import PolicyConfig
from supervisor.core.model import Cause, Remedy


def backoff_delay(failures: int, cfg: PolicyConfig, jitter_sample: float) -> float:
    """Delay before restart number ``failures`` (1 = first crash of a streak): the
    configured exponential backoff with a jitter of +-``backoff_jitter``.

    ``jitter_sample`` is a uniform draw from [0, 1) supplied by the caller.
    """
    if failures <= 0 or cfg.backoff_initial_s == 0:
        return 0.0
    return exponential_backoff(
        failures - 1, initial=cfg.backoff_initial_s, factor=cfg.backoff_factor, maximum=cfg.backoff_max_s,
        jitter=(1.0 - cfg.backoff_jitter, 1.0 + cfg.backoff_jitter), sample=jitter_sample,
    )


def fraction_below(current: float, ladder: tuple[float, ...]) -> float | None:
    """The next rung strictly below ``current``; None below the floor."""
    lower = [r for r in ladder if r < current - 1e-9]
    return max(lower) if lower else None


def fraction_above(
    current: float, ladder: tuple[float, ...], oom_fractions: frozenset[float]
) -> float | None:
    """The next rung strictly above ``current`` that is below every fraction that OOMed."""
    ceiling = min(oom_fractions) if oom_fractions else math.inf
    higher = [r for r in ladder if current + 1e-9 < r < ceiling - 1e-9]
    return min(higher) if higher else None


def rung_of(fraction: float | None, ladder: tuple[float, ...]) -> int:
    """Index of the rung at or just below ``fraction`` (0 = top; SGLang's choice counts as 0)."""
    if fraction is None:
        return 0
    for i, r in enumerate(ladder):
        if fraction >= r - 1e-9:
            return i
    return len(ladder) - 1


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do after a crash: relaunch with these settings after ``delay_s``, or not."""

    give_up: bool
    reason: str
    fraction: float | None  # None: SGLang's own choice, the flag left out
    hicache_size_gb: int
    delay_s: float = 0.0


def decide(
    *,
    cause: Cause,
    remedy: Remedy,
    fraction: float | None,
    hicache_size_gb: int,
    oom_fractions: frozenset[float],
    crashes_in_window: int,
    failures: int,
    cfg: PolicyConfig,
    jitter_sample: float,
    immediate: bool = False,
    min_fraction: float | None = None,
) -> Decision:
    """The policy's answer to one crash.

    ``crashes_in_window`` counts this crash too; ``failures`` is the streak length used for
    the backoff; ``immediate`` skips the delay (a preemptive step-down is no crash).
    ``fraction`` None means SGLang chose it and its log never said what: the ladder cannot
    step from an unknown value, so the restart keeps SGLang's choice. ``min_fraction`` is the
    least fraction SGLang itself named: a step up goes past it.
    """
    ladder = cfg.fraction_ladder

    def stop(reason: str) -> Decision:
        return Decision(True, reason, fraction, hicache_size_gb)

    if remedy is Remedy.GIVE_UP:
        return stop(f"{cause.summary} cannot be fixed by a restart")
    if crashes_in_window >= cfg.max_crashes:
        return stop(f"{crashes_in_window} crashes within {cfg.crash_window_s:g} s (last: {cause.summary})")

    new_fraction, new_hicache = fraction, hicache_size_gb
    if remedy is Remedy.FRACTION_DOWN and fraction is not None:
        lower = fraction_below(fraction, ladder)
        if lower is None:
            return stop(
                f"{cause.summary} at mem_fraction_static {fraction:g}, the ladder's floor "
                f"({ladder[-1]:g}); lower it further by hand or reduce the load"
            )
        new_fraction = lower
    elif remedy is Remedy.FRACTION_UP and (fraction is not None or min_fraction is not None):
        start = max(x for x in (fraction, min_fraction) if x is not None)
        higher = fraction_above(start, ladder, oom_fractions)
        if higher is None:
            named = f" (SGLang asks for more than {min_fraction:g})" if min_fraction is not None else ""
            return stop(
                f"{cause.summary} at mem_fraction_static {_show(fraction)}{named} and no higher rung "
                "is left that has not run out of CUDA memory"
            )
        new_fraction = higher
    elif remedy is Remedy.HICACHE_DOWN and hicache_size_gb > 0:
        halved = hicache_size_gb // 2
        new_hicache = halved if halved >= cfg.hicache_min_gb else 0

    delay = 0.0 if immediate else backoff_delay(failures, cfg, jitter_sample)
    changes = []
    if new_fraction != fraction:
        changes.append(f"mem_fraction_static {_show(fraction)} -> {_show(new_fraction)}")
    if new_hicache != hicache_size_gb:
        changes.append(f"hicache_size_gb {hicache_size_gb} -> {new_hicache}")
    reason = f"{cause.summary}: " + (", ".join(changes) if changes else "restart unchanged")
    return Decision(False, reason, new_fraction, new_hicache, delay)


def _show(fraction: float | None) -> str:
    return "SGLang's choice" if fraction is None else f"{fraction:g}"
