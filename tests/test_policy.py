"""Unit tests of the restart policy (issue 2): the backoff table, jitter bounds, overflow
safety, the fraction ladder (down, up, floor, ceiling under OOMed fractions), the hierarchical
cache halving, and the give-up rules. Pure functions: no clock, no event loop.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.core.backoff import exponential_backoff
from supervisor.core.config import PolicyConfig
from supervisor.core.model import Cause, Remedy
from supervisor.core.policy import (
    Decision,
    backoff_delay,
    decide,
    fraction_above,
    fraction_below,
    rung_of,
)

CFG = PolicyConfig()  # 10 s x2, cap 300 s, +-10 % jitter, 5 crashes per hour, ladder below
LADDER = (0.93, 0.88, 0.85, 0.82, 0.80)
NO_JITTER = 0.5  # the middle of [0, 1) maps to a spread of exactly 0


def test_defaults_are_the_documented_policy() -> None:
    """The defaults are Kubernetes-like: 10 s doubling to 300 s, +-10 %, reset after 600 s."""
    assert (CFG.backoff_initial_s, CFG.backoff_factor, CFG.backoff_max_s) == (10.0, 2.0, 300.0)
    assert (CFG.backoff_jitter, CFG.stable_after_s) == (0.1, 600.0)
    assert (CFG.max_crashes, CFG.crash_window_s, CFG.fraction_ladder) == (5, 3600.0, LADDER)


# --- backoff ----------------------------------------------------------------------------------


def test_backoff_table_without_jitter() -> None:
    """Failures 1..12 wait 10, 20, 40, 80, 160 s, then the 300 s cap."""
    table = [backoff_delay(n, CFG, NO_JITTER) for n in range(1, 13)]
    assert table == [10.0, 20.0, 40.0, 80.0, 160.0] + [300.0] * 7


def test_backoff_is_zero_before_any_failure() -> None:
    """No failure (or a nonsense negative count) means no delay."""
    assert backoff_delay(0, CFG, NO_JITTER) == 0.0
    assert backoff_delay(-3, CFG, NO_JITTER) == 0.0


def test_backoff_initial_zero_disables_the_delay() -> None:
    """backoff_initial_s = 0 restarts at once, whatever the streak."""
    assert backoff_delay(7, replace(CFG, backoff_initial_s=0.0), 0.99) == 0.0


@pytest.mark.parametrize("failures", [1, 3, 6, 12])
def test_backoff_jitter_bounds(failures: int) -> None:
    """The extremes of the jitter sample give -10 % and +10 % of the base (the cap bounds the
    base, so at the cap the delay spreads over 270..330 s)."""
    base = backoff_delay(failures, CFG, NO_JITTER)
    assert backoff_delay(failures, CFG, 0.0) == pytest.approx(base * 0.9)
    assert backoff_delay(failures, CFG, math.nextafter(1.0, 0.0)) == pytest.approx(base * 1.1)


@given(failures=st.integers(1, 40), sample=st.floats(0.0, 1.0, exclude_max=True))
def test_backoff_always_within_jitter_of_the_capped_base(failures: int, sample: float) -> None:
    """Every delay lies within +-10 % of min(10 * 2**(n-1), 300)."""
    base = min(10.0 * 2.0 ** (failures - 1), 300.0)
    delay = backoff_delay(failures, CFG, sample)
    assert base * 0.9 - 1e-9 <= delay <= base * 1.1 + 1e-9


@pytest.mark.parametrize("failures", [64, 65, 1_000, 10**18])
@pytest.mark.parametrize("factor", [2.0, 1e10, 1e300])
def test_huge_failure_counts_do_not_overflow(failures: int, factor: float) -> None:
    """Any streak length and any finite factor give the cap, never an OverflowError or inf."""
    cfg = replace(CFG, backoff_factor=factor)
    assert backoff_delay(failures, cfg, NO_JITTER) == 300.0


def test_backoff_factor_one_is_a_constant_delay() -> None:
    """backoff_factor = 1 waits backoff_initial_s every time."""
    cfg = replace(CFG, backoff_factor=1.0, backoff_jitter=0.0)
    assert {backoff_delay(n, cfg, 0.3) for n in (1, 2, 50, 10**9)} == {10.0}


def test_exponential_backoff_is_the_one_backoff_for_restarts_and_reconnects() -> None:
    """The shared function: n counts from 0, the cap clamps, the jitter window (low, high) is
    the multiplier's range; the MQTT reconnect's [d/2, d] is one such window."""
    def b(n: int, window: tuple[float, float], sample: float) -> float:
        return exponential_backoff(n, initial=1.0, factor=2.0, maximum=60.0, jitter=window, sample=sample)

    assert [b(n, (1.0, 1.0), 0.7) for n in (0, 1, 3, 6, 10**18)] == [1.0, 2.0, 8.0, 60.0, 60.0]
    assert b(3, (0.5, 1.0), 0.0) == 4.0
    assert b(3, (0.5, 1.0), math.nextafter(1.0, 0.0)) == pytest.approx(8.0)
    assert b(-5, (0.5, 1.0), 0.0) == 0.5  # a negative count is the first wait
    assert exponential_backoff(10**9, initial=1.0, factor=1e300, maximum=60.0, jitter=(1.0, 1.0), sample=0.0) == 60.0
    assert exponential_backoff(0, initial=1.0, factor=2.0, maximum=60.0, jitter=(-1.0, 1.0), sample=0.0) == 0.0


# --- the ladder -------------------------------------------------------------------------------


def test_ladder_down_one_rung_at_a_time() -> None:
    """Runtime OOM walks 0.93 -> 0.88 -> 0.85 -> 0.82 -> 0.80 and then has no rung left."""
    walk = [0.93]
    while (lower := fraction_below(walk[-1], LADDER)) is not None:
        walk.append(lower)
    assert walk == list(LADDER)


def test_ladder_down_from_between_rungs() -> None:
    """A configured fraction off the ladder steps to the next rung strictly below it."""
    assert fraction_below(0.95, LADDER) == 0.93
    assert fraction_below(0.9, LADDER) == 0.88
    assert fraction_below(0.80, LADDER) is None


def test_ladder_up_one_rung_at_a_time() -> None:
    """With no OOM seen, a KV-pool failure climbs one rung and stops at the top."""
    assert fraction_above(0.80, LADDER, frozenset()) == 0.82
    assert fraction_above(0.88, LADDER, frozenset()) == 0.93
    assert fraction_above(0.93, LADDER, frozenset()) is None


def test_ladder_up_stays_below_every_fraction_that_oomed() -> None:
    """The ceiling is the lowest fraction that ran out of CUDA memory, exclusive."""
    oomed = frozenset({0.93, 0.85})
    assert fraction_above(0.80, LADDER, oomed) == 0.82
    assert fraction_above(0.82, LADDER, oomed) is None
    assert fraction_above(0.85, LADDER, frozenset({0.93})) == 0.88
    assert fraction_above(0.88, LADDER, frozenset({0.93})) is None


def test_rung_of_names_the_rung_at_or_below() -> None:
    """rung_of gives the ladder index (0 = top) for the metrics' rung label."""
    assert [rung_of(f, LADDER) for f in LADDER] == [0, 1, 2, 3, 4]
    assert rung_of(0.95, LADDER) == 0
    assert rung_of(0.87, LADDER) == 2
    assert rung_of(0.5, LADDER) == 4


# --- decide -----------------------------------------------------------------------------------


def _decide(cause: Cause, *, remedy: Remedy | None = None, fraction: float = 0.93,
            hicache: int = 0, oomed: frozenset[float] = frozenset(), crashes: int = 1,
            failures: int = 1, cfg: PolicyConfig = CFG, immediate: bool = False) -> Decision:
    return decide(
        cause=cause, remedy=remedy or cause.remedy, fraction=fraction, hicache_size_gb=hicache,
        oom_fractions=oomed, crashes_in_window=crashes, failures=failures, cfg=cfg,
        jitter_sample=NO_JITTER, immediate=immediate,
    )


def test_runtime_oom_steps_down_with_backoff() -> None:
    """A runtime CUDA OOM at 0.93 restarts at 0.88 after the streak's delay."""
    d = _decide(Cause.CUDA_OOM_RUNTIME, failures=2)
    assert (d.give_up, d.fraction, d.delay_s) == (False, 0.88, 20.0)
    assert "0.93 -> 0.88" in d.reason


def test_runtime_oom_at_the_floor_gives_up() -> None:
    """Below the ladder's floor there is nothing left to try: give up and say so."""
    d = _decide(Cause.CUDA_OOM_RUNTIME, fraction=0.80)
    assert d.give_up and d.fraction == 0.80
    assert "floor" in d.reason


def test_kv_pool_too_small_steps_up_and_gives_up_at_the_ceiling() -> None:
    """The startup KV-pool error raises one rung, never into a fraction that OOMed."""
    assert _decide(Cause.KV_POOL_TOO_SMALL, fraction=0.85).fraction == 0.88
    assert _decide(Cause.KV_POOL_TOO_SMALL, fraction=0.85, oomed=frozenset({0.88})).give_up
    assert _decide(Cause.KV_POOL_TOO_SMALL, fraction=0.93).give_up


@pytest.mark.parametrize(
    ("size", "halved"), [(48, 24), (24, 12), (16, 8), (15, 0), (9, 0), (0, 0)]
)
def test_host_oom_halves_the_hierarchical_cache(size: int, halved: int) -> None:
    """Host OOM halves hicache_size_gb; below hicache_min_gb (8) it turns it off."""
    d = _decide(Cause.HOST_OOM, hicache=size)
    assert (d.give_up, d.hicache_size_gb, d.fraction) == (False, halved, 0.93)


@pytest.mark.parametrize(
    ("cause", "remedy"),
    [
        (Cause.CONFIG_ERROR, None),
        (Cause.MODEL_LOAD_ERROR, None),
        (Cause.GPU_HW_ERROR, None),
        (Cause.GPU_MEMORY_STUCK, None),
        (Cause.CUDA_ERROR, Remedy.GIVE_UP),
    ],
)
def test_causes_a_restart_cannot_fix_give_up_at_once(cause: Cause, remedy: Remedy | None) -> None:
    """Unfixable causes (and deterministic CUDA errors) give up on the first crash."""
    d = _decide(cause, remedy=remedy)
    assert d.give_up
    assert cause.summary in d.reason


def test_oom_while_loading_weights_keeps_the_fraction() -> None:
    """CLEAR_GPU (weights did not fit: something else holds the GPU) restarts unchanged."""
    d = _decide(Cause.CUDA_OOM_STARTUP, remedy=Remedy.CLEAR_GPU)
    assert (d.give_up, d.fraction, d.delay_s) == (False, 0.93, 10.0)
    assert "restart unchanged" in d.reason


@pytest.mark.parametrize("cause", [Cause.NCCL_ERROR, Cause.HANG, Cause.WATCHDOG_HANG, Cause.OTHER])
def test_plain_restart_causes_keep_everything(cause: Cause) -> None:
    """Causes without a memory remedy restart with the same fraction and cache."""
    d = _decide(cause, hicache=48)
    assert (d.give_up, d.fraction, d.hicache_size_gb) == (False, 0.93, 48)


def test_give_up_window() -> None:
    """max_crashes crashes within the window give up, one fewer still restarts."""
    assert not _decide(Cause.NCCL_ERROR, crashes=4).give_up
    d = _decide(Cause.NCCL_ERROR, crashes=5)
    assert d.give_up
    assert "5 crashes within 3600 s" in d.reason


def test_give_up_window_wins_over_a_fraction_step() -> None:
    """A spent crash budget gives up even when a lower rung is still available."""
    assert _decide(Cause.CUDA_OOM_RUNTIME, crashes=5).give_up


def test_immediate_step_down_has_no_delay() -> None:
    """A preemptive (headroom) step-down relaunches at once at the next rung."""
    d = _decide(Cause.HEADROOM_LOW, failures=4, immediate=True)
    assert (d.give_up, d.fraction, d.delay_s) == (False, 0.88, 0.0)
