"""Issue 25's simulator night (tests/capacity_night.py): a server that starts at 0.80 on a
simulated GPU whose true boundary is known climbs, under steady load with bursts and behind
the real SGLang router with a second server, to the highest fraction below the boundary in
a bounded number of climbs; the one climb past the boundary falls back within probation; the
client sees no failed request during the climbs; the other server is never restarted.

Prints the climbs, the fractions, the KV tokens and the failed-request count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import capacity_night as cn
import pytest

pytestmark = pytest.mark.integration

MAX_CLIMBS = 4  # one step (the model knows one fraction), f* (past the boundary), f* again


def _of(events: list[dict[str, Any]], kind: str, server: str = "a") -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind and e.get("server") == server]


def _windows(events: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """Each climb (decision -> READY at the new fraction) and the fall-back (the server's
    death -> READY at the last stable fraction), as (name, start, end) in monotonic seconds."""
    ready = [e["mono"] for e in _of(events, "server_ready")]
    out = []
    for i, c in enumerate(_of(events, "climb"), 1):
        end = next((r for r in ready if r > c["mono"]), math.inf)
        out.append((f"climb {i} {c['mem_fraction_before']:g}->{c['mem_fraction_static']:g}", c["mono"], end))
    for f in _of(events, "climb_fell_back"):
        down = max((e["mono"] for e in _of(events, "server_down") if e["mono"] <= f["mono"]), default=f["mono"])
        end = next((r for r in ready if r > f["mono"]), math.inf)
        out.append((f"fall-back {f['mem_fraction_failed']:g}->{f['mem_fraction_static']:g}", down, end))
    return out


def _kv_tokens_by_fraction(events: list[dict[str, Any]]) -> dict[float, int]:
    """KV tokens of each of a's launches, from its start-up facts (the fraction of the launch
    that reported them)."""
    out: dict[float, int] = {}
    fraction = None
    for e in events:
        if e.get("server") != "a":
            continue
        if e.get("event") == "launch":
            fraction = e["mem_fraction_static"]
        elif e.get("event") == "startup_facts" and fraction is not None:
            tokens = e.get("kv_cache_tokens") or e.get("max_total_num_tokens")
            if tokens:
                out[round(fraction, 6)] = tokens
    return out


def table(result: dict[str, Any]) -> tuple[str, dict[str, list[cn.Sent]]]:
    events, sent = result["events"], result["sent"]
    kv = _kv_tokens_by_fraction(events)
    windows = _windows(events)
    failed: dict[str, list[cn.Sent]] = {name: [] for name, _, _ in windows}
    failed["outside the climbs"] = []
    for s in sent:
        if s.ok:
            continue
        name = next((n for n, a, b in windows if a <= s.end <= b), "outside the climbs")
        failed[name].append(s)
    fell = {round(f["mem_fraction_failed"], 6) for f in _of(events, "climb_fell_back")}
    kept = {round(k["mem_fraction_static"], 6) for k in _of(events, "climb_kept")}
    lines = [f"true boundary for {cn.BIG_BURST}-token bursts: {cn.boundary(cn.BIG_BURST):.4f}; "
             f"for {cn.SMALL_BURST}: {cn.boundary(cn.SMALL_BURST):.4f}; floor {cn.HEADROOM_MIN_GB + cn.MARGIN_GB:g} GB",
             f"{'climb':<6}{'from -> to':<14}{'KV tokens before -> after':<28}{'outcome':<34}{'failed':>6}"]
    for i, c in enumerate(_of(events, "climb"), 1):
        before, to = c["mem_fraction_before"], c["mem_fraction_static"]
        outcome = ("fell back (runtime OOM within probation)" if round(to, 6) in fell
                   else "kept (probation passed)" if round(to, 6) in kept else "on probation")
        name = f"climb {i} {before:g}->{to:g}"
        tokens = f"{kv.get(round(before, 6), '?')} -> {kv.get(round(to, 6), '?')}"
        lines.append(f"{i:<6}{f'{before:g} -> {to:g}':<14}{tokens:<28}{outcome:<34}{len(failed[name]):>6}")
    for f in _of(events, "climb_fell_back"):
        name = f"fall-back {f['mem_fraction_failed']:g}->{f['mem_fraction_static']:g}"
        moved, cause = f"{f['mem_fraction_failed']:g} -> {f['mem_fraction_static']:g}", f"cause {f['cause']}"
        lines.append(f"{'back':<6}{moved:<14}{'':<28}{cause:<34}{len(failed[name]):>6}")
    launches = [e["mem_fraction_static"] for e in _of(events, "launch")]
    ok = sum(s.ok for s in sent)
    lines.append(f"fractions of a, launch by launch: {' -> '.join(f'{x:g}' for x in launches)}")
    lines.append(f"requests: {ok} ok, {len(sent) - ok} failed "
                 f"({', '.join(f'{k}: {len(v)}' for k, v in failed.items())})")
    for name, bad in failed.items():
        for s in bad[:3]:
            lines.append(f"  failed in {name}: {s.kind} {s.words} words: {s.error}")
    return "\n".join(lines), failed


@pytest.mark.timeout(420)  # about 2 minutes: two probations of 40 s, drains, relaunches
async def test_a_server_climbs_to_the_highest_fraction_below_its_boundary_without_a_failed_request(
    tmp_path: Path, start_router: Callable[..., str]
) -> None:
    result = await cn.night(tmp_path, start_router)
    text, failed = table(result)
    print("\n" + text)
    events = result["events"]
    climbs = _of(events, "climb")
    boundary = cn.boundary(cn.BIG_BURST)
    final = cn.highest_below(cn.BIG_BURST)

    # bounded: the climbs, in order, each from where the last one left the server
    assert 1 <= len(climbs) <= MAX_CLIMBS, text
    assert cn.fraction_is(climbs[0]["mem_fraction_before"], cn.START), text
    assert cn.fraction_is(climbs[0]["mem_fraction_static"], round(cn.START + cn.STEP, 6)), text  # one step: no model yet

    # exactly one climb went past the boundary, and it fell back within probation to the
    # last stable fraction, which the climb had left
    fell = _of(events, "climb_fell_back")
    assert len(fell) == 1, text
    back = fell[0]
    past = next(c for c in climbs if cn.fraction_is(c["mem_fraction_static"], back["mem_fraction_failed"]))
    assert back["mem_fraction_failed"] > boundary, text
    assert cn.fraction_is(back["mem_fraction_static"], past["mem_fraction_before"]), text
    assert back["cause"] == "cuda_oom_runtime", text
    assert back["mono"] - past["mono"] <= cn.PROBATION_S, text
    for c in climbs:
        if c is not past:
            assert c["mem_fraction_static"] < boundary, text

    # a ends at the highest step below the boundary that leaves the floor at the big burst's
    # peak, and serves there through its probation
    launches = _of(events, "launch")
    assert cn.fraction_is(launches[-1]["mem_fraction_static"], final), text
    assert cn.fraction_is(climbs[-1]["mem_fraction_static"], final), text
    assert any(cn.fraction_is(k["mem_fraction_static"], final) for k in _of(events, "climb_kept")), text
    assert final < boundary < round(final + cn.STEP, 6), text

    # each launch's KV pool is the simulator's 12·f − 9 GiB, in tokens
    kv = _kv_tokens_by_fraction(events)
    for fraction, tokens in kv.items():
        assert tokens == cn.kv_tokens(fraction), (fraction, tokens, text)

    # the client: no failed request during the climbs
    for name, bad in failed.items():
        if name.startswith("climb"):
            assert not bad, text
    assert sum(s.ok for s in result["sent"]) > 0, text

    # b was never restarted
    assert len(_of(events, "launch", "b")) == 1, text
    assert not _of(events, "crash", "b"), text
