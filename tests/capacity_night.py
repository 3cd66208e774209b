"""Issue 25's simulator night: a server that starts at 0.80 climbs to the highest fraction
below its GPU's true boundary, behind the real SGLang router with a second server, under
steady load with bursts (tests/test_capacity_night.py asserts on it).

One real daemon owns two simulated servers (``[[server]]``: ``a`` with ``[policy] climb =
true``, ``b`` without), each alone on a small simulated card whose memory model is known:

- card 12 GiB, weights 9 GiB, CUDA graphs 0.5 GiB, 0.25 MiB of activations per prefill token,
  chunked prefill 2048 (a burst is at most one chunk);
- with nobody else on the card (0.5.23): KV pool = 12·f − 9 GiB (0.80: 9,167 tokens of
  70,272 bytes), headroom after capture = 12·(1 − f) − 0.5 GiB;
- a 1024-token burst needs 0.25 GiB, a 2048-token one 0.5 GiB: the true boundary for the
  2048 bursts is ``simulator.boundary_fraction`` = 1 − (0.5 + 0.5)/12 = 0.9167.

The night, driven in phases (each phase waits for the daemon's own events, never a clock);
``[gpu] headroom_min_gb`` 0.05 + ``[policy] climb_margin_gb`` 0.02 = a floor of 0.07 GB:

A. ``a`` at 0.80, stable: a few 1024-token bursts, then KV pressure (long decodes that fill
   the pool: SGLang's retraction line) → the model knows one fraction only → climb one
   ``climb_step``: 0.81;
B. at 0.81 (two fractions known): 1024 bursts until the recommendation has seen their peak
   (above 0.81 and at most 0.93, the highest step leaving the floor at 0.25 GB), then,
   climb 1 kept (no climb on probation), KV pressure → climb to f* = 0.93: the model has
   never seen a 2048 burst, and 0.93 is past its boundary (0.9167);
C. at 0.93: 2048 bursts → a runtime CUDA OOM within probation → ``climb_fell_back`` to
   0.81 at once, 0.93 a ceiling from then on;
D. back at 0.81: 2048 bursts until the recommendation has seen them (0.91: 12·0.09 − 0.5 −
   0.5 = 0.08 ≥ 0.07, 0.92 would leave −0.04), KV pressure → climb to 0.91;
E. at 0.91: the 2048 bursts serve; probation passes (``climb_kept``).

Every request goes through the router (round robin); each is recorded with its start, end
and outcome, so a failure is attributed to the window it happened in.
"""

from __future__ import annotations

import asyncio
import math
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w
from conftest import wait_until
from harness import DaemonRun, merge_servers, write_config
from router_night import listed

from supervisor.sim import simgpu, simulator
from supervisor.sim.loadgen import prompt

GIB = 1024**3

# The simulated card and the model's knobs (see the module docstring).
TOTAL_GB = 12.0
WEIGHTS_GB = 9.0
GRAPH_GB = 0.5
ACT_MB_PER_TOKEN = 0.25
CHUNK = 2048
SMALL_BURST = 1024  # the bursts the model learns from first
BIG_BURST = 2048  # the rare burst that arrives later
START = 0.80
LADDER = (0.95, 0.93, 0.9, 0.85, 0.8)
HEADROOM_MIN_GB = 0.05
MARGIN_GB = 0.02
STEP = 0.01
STABLE_S = 3.0
CLIMB_INTERVAL_S = 5.0
PROBATION_S = 40.0
STOP_GRACE_S = 60.0  # a climb drains: the in-flight long decodes finish first

# KV pressure: long decodes of tiny prompts. Round robin gives ``a`` about half; at 0.81 its
# 11,001-token pool holds ~7 of them at their end, so several retract. A retracted request is
# prefilled again only when others finish (seconds later): by then the climb has begun. (With
# 20, ``a`` once peaked at 9 running and 8,760 tokens on a loaded machine, retracted nothing
# and never climbed: 26 leaves margin.)
PRESSURE_CLIENTS = 26
PRESSURE_MAX_NEW = 1500
STEADY_CLIENTS = 2


def act_bytes_per_token() -> float:
    return ACT_MB_PER_TOKEN * 1024**2


def boundary(burst_tokens: int) -> float:
    """The simulator's own arithmetic: above this fraction a burst of ``burst_tokens`` OOMs."""
    return simulator.boundary_fraction(TOTAL_GB, GRAPH_GB, act_bytes_per_token(), burst_tokens)


def highest_below(burst_tokens: int) -> float:
    """The highest ``STEP`` whose headroom at the burst's peak stays at or above the floor
    (``headroom_min_gb + climb_margin_gb``): the fraction the climbs should end at."""
    floor = HEADROOM_MIN_GB + MARGIN_GB
    peak = burst_tokens * act_bytes_per_token() / GIB
    k = math.floor(1 / STEP)
    while TOTAL_GB * (1 - k * STEP) - GRAPH_GB - peak < floor - 1e-9:
        k -= 1
    return round(k * STEP, 6)


def kv_tokens(fraction: float) -> int:
    """The simulator's KV pool in tokens at ``fraction`` (nobody else on the card)."""
    return int(max(0.0, TOTAL_GB * fraction - WEIGHTS_GB) * GIB // simulator.KV_BYTES_PER_TOKEN)


# --- the client ------------------------------------------------------------------------------


@dataclass
class Sent:
    kind: str  # steady | burst | pressure
    words: int
    start: float  # time.monotonic(): the daemon's "mono" is the same clock
    end: float = 0.0
    ok: bool = False
    error: str = ""


@dataclass
class Client:
    """Every request goes through the router; each one is recorded."""

    url: str
    sent: list[Sent] = field(default_factory=list)
    _stops: dict[str, asyncio.Event] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _http: Any = None

    async def __aenter__(self) -> Client:
        import aiohttp

        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for stop in self._stops.values():
            stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.close()

    async def one(self, kind: str, words: int, max_new: int, seed: int) -> Sent:
        import aiohttp

        rec = Sent(kind, words, time.monotonic())
        self.sent.append(rec)
        payload = {"text": prompt(words, seed), "sampling_params": {"max_new_tokens": max_new}}
        try:
            async with self._http.post(self.url + "/generate", json=payload,
                                       timeout=aiohttp.ClientTimeout(total=180)) as resp:
                body = await resp.read()
                rec.ok = resp.status == 200
                if not rec.ok:
                    rec.error = f"HTTP {resp.status}: {body[:160]!r}"
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            rec.error = repr(exc)[:200]
        rec.end = time.monotonic()
        return rec

    def loop(self, kind: str, clients: int, words: int, max_new: int, *, pause_s: float = 0.01) -> None:
        """``clients`` closed-loop clients until ``stop(kind)``."""
        stop = self._stops.setdefault(kind, asyncio.Event())
        stop.clear()

        async def client(n: int) -> None:
            await asyncio.sleep(n * 0.05)  # not all in the same prefill batch
            seed = n
            while not stop.is_set():
                await self.one(kind, words, max_new, seed)
                seed += clients
                await asyncio.sleep(pause_s)

        self._tasks += [asyncio.create_task(client(n)) for n in range(clients)]

    def stop(self, kind: str) -> None:
        self._stops[kind].set()

    async def bursts_until(self, words: int, done: Callable[[], bool], timeout_s: float, what: str) -> int:
        """One burst of ``words`` at a time (round robin sends about every other one to each
        server) until ``done()``; bounded by ``timeout_s``. Returns how many were sent."""
        deadline = time.monotonic() + timeout_s
        n = 0
        while not await asyncio.to_thread(done):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not after {n} bursts of {words} tokens in {timeout_s:g} s")
            await self.one("burst", words, 4, 1000 + n)
            n += 1
            await asyncio.sleep(0.3)  # a GPU sample (interval 0.25 s) sees the peak
        return n


# --- the configuration -----------------------------------------------------------------------


def configs(tmp_path: Path) -> Path:
    """One daemon's config: servers ``a`` (climbs) and ``b``, each on its own 12 GiB card."""
    gpus = tmp_path / "gpus"
    simgpu.ensure_gpus(gpus, 2, TOTAL_GB)  # before write_config, which would make 96 GB cards
    sim_args = ("--sim-version", "0.5.23", "--sim-gpu-total-gb", f"{TOTAL_GB:g}", "--sim-weights-gb", f"{WEIGHTS_GB:g}",
                "--sim-graph-gb", f"{GRAPH_GB:g}", "--sim-act-mb-per-token", f"{ACT_MB_PER_TOKEN:g}",
                "--chunked-prefill-size", str(CHUNK))
    paths = []
    for name in ("a", "b"):
        tmp = tmp_path / name
        tmp.mkdir()
        sections: dict[str, dict[str, Any]] = {
            "server": {"tp_size": 1, "mem_fraction_static": START, "stop_grace_s": STOP_GRACE_S},
            "health": {"interval_s": 1.0, "failures": 3, "timeout_s": 5.0, "startup_timeout_s": 60.0},
            "policy": {"fraction_ladder": list(LADDER), "stable_after_s": STABLE_S, "climb_step": STEP,
                       "climb_margin_gb": MARGIN_GB, "climb_interval_s": CLIMB_INTERVAL_S, "probation_s": PROBATION_S,
                       "kv_pressure_every_s": 5.0},
            "gpu": {"headroom_min_gb": HEADROOM_MIN_GB, "interval_s": 0.25, "low_free_warn_gb": 0.0},
        }
        paths.append(write_config(tmp, sections, sim_args=sim_args, name=name))
        # write_config made its own GPU directory: every server uses the 12 GiB cards
        text = paths[-1].read_text().replace(str(tmp / "gpus"), str(gpus))
        paths[-1].write_text(text)
    merged = merge_servers(paths, tmp_path / "pair.toml", ((0,), (1,)))
    doc = tomllib.loads(merged.read_text())
    doc["server"][0]["policy"] = {"climb": True}  # a climbs; b is the one that serves meanwhile
    merged.write_text(tomli_w.dumps(doc))
    return merged


# --- the night -------------------------------------------------------------------------------


def a_events(d: DaemonRun, kind: str, **match: Any) -> list[dict[str, Any]]:
    return d.find(kind, server="a", **match)


def fraction_is(value: float | None, want: float) -> bool:
    return value is not None and math.isclose(float(value), want, abs_tol=1e-6)


async def night(tmp_path: Path, start_router: Callable[..., str]) -> dict[str, Any]:
    cfg = configs(tmp_path)
    urls = sorted(url_of_server(cfg, name) for name in ("a", "b"))
    router = await asyncio.to_thread(start_router, "--policy", "round_robin")
    cfg.write_text(cfg.read_text() + f'\n[router]\nenabled = true\nurl = "{router}"\nreconcile_s = 2.0\n')
    phases: dict[str, float] = {}
    with DaemonRun(cfg) as d:
        for name in ("a", "b"):
            await asyncio.to_thread(d.wait_for, "server_ready", 90, server=name)
        await asyncio.to_thread(wait_until, lambda: listed(router) == urls, 30, 0.05, "both servers listed")
        async with Client(router) as client:
            client.loop("steady", STEADY_CLIENTS, 8, 4)
            phases["start"] = time.monotonic()

            # A. at 0.80: bursts of 1024, then KV pressure -> one step up
            await climb_under_pressure(d, client, 1, bursts=SMALL_BURST, upto=None)
            # B. at 0.81: bursts of 1024 until the model recommends higher, pressure -> f*
            await climb_under_pressure(d, client, 2, bursts=SMALL_BURST, upto=highest_below(SMALL_BURST))
            # C. at f*: bursts of 2048 until the climb falls back
            await asyncio.to_thread(d.wait_for, "server_ready", 120, count=3, server="a")
            phases["bursts_at_fstar"] = time.monotonic()
            await client.bursts_until(BIG_BURST, lambda: bool(a_events(d, "climb_fell_back")), 90,
                                      "a climb past the boundary falls back")
            # D. back at the last stable fraction: bursts of 2048 until the model has seen them,
            # pressure -> the highest fraction below the boundary
            await climb_under_pressure(d, client, 3, bursts=BIG_BURST, upto=highest_below(BIG_BURST), ready_count=4)
            # E. at the final fraction: the big bursts serve; probation passes
            final = await asyncio.to_thread(d.wait_for, "server_ready", 120, count=5, server="a")
            phases["final_ready"] = time.monotonic()
            await client.bursts_until(BIG_BURST, lambda: any(k["mono"] >= final["mono"] for k in a_events(d, "climb_kept")),
                                      PROBATION_S + 60, "the last climb is kept")
            client.stop("steady")
            await asyncio.sleep(1.0)
            phases["end"] = time.monotonic()
        events = d.events()
    return {"events": events, "sent": client.sent, "phases": phases}


def wait_after(d: DaemonRun, kind: str, mono: float, timeout_s: float) -> dict[str, Any]:
    """``a``'s first ``kind`` event at or after ``mono`` (bounded by ``timeout_s``)."""
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = [e for e in a_events(d, kind) if e["mono"] >= mono]
        return bool(found)

    wait_until(seen, timeout_s, 0.1, f"a's {kind} after {mono:.1f}")
    return found[0]


def url_of_server(cfg: Path, name: str) -> str:
    doc = tomllib.loads(cfg.read_text())
    entry = next(s for s in doc["server"] if s["name"] == name)
    return f"http://127.0.0.1:{entry['port']}"


async def climb_under_pressure(d: DaemonRun, client: Client, n: int, *, bursts: int, upto: float | None,
                               ready_count: int | None = None) -> None:
    """``a``'s climb number ``n``: once it is READY (its ``ready_count``-th time), bursts of
    ``bursts`` tokens until the model recommends a fraction above the current one and at most
    ``upto`` (it has seen a peak that large: None, no model yet), then, once stable and off
    probation, KV pressure until the daemon climbs; the pressure stops there (what is in
    flight drains)."""
    ready = await asyncio.to_thread(d.wait_for, "server_ready", 120, count=ready_count or n, server="a")

    def learned() -> bool:
        if upto is None:
            return True
        # the last one said: the daemon tells a recommendation when it changes (at the latest
        # at READY), so this launch's may come before its READY
        recs = [r for r in a_events(d, "recommended_fraction")
                if r.get("mem_fraction_static") == ready["mem_fraction_static"]]
        rec = recs[-1].get("fraction") if recs else None
        return rec is not None and ready["mem_fraction_static"] + 1e-9 < rec <= upto + 1e-9

    sent = 0  # a few bursts even when the model needs none yet (phase A: one fraction known)
    while sent < 4 or not await asyncio.to_thread(learned):
        if sent > 200:
            raise AssertionError(f"climb {n}: the model never recommended above the fraction and <= {upto}")
        await client.one("burst", bursts, 4, 2000 * n + sent)
        sent += 1
        await asyncio.sleep(0.3)
    # stable, the previous climb settled (kept or fallen back: no climb on probation) and
    # longer ago than climb_interval_s: the first KV pressure climbs
    await asyncio.to_thread(wait_after, d, "stable", ready["mono"], 60)
    await asyncio.to_thread(wait_until, lambda: len(a_events(d, "climb_kept")) + len(a_events(d, "climb_fell_back"))
                            >= n - 1, PROBATION_S + 60, 0.2, f"climb {n - 1} settled")
    climbs = a_events(d, "climb")
    if climbs:
        wait = climbs[-1]["mono"] + CLIMB_INTERVAL_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait + 0.1)
    client.loop("pressure", PRESSURE_CLIENTS, 8, PRESSURE_MAX_NEW)
    try:
        await asyncio.to_thread(d.wait_for, "climb", 120, count=n, server="a")
    finally:
        client.stop("pressure")
