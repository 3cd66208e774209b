"""The demo's load generator: a burst of concurrent prefill that rides out server restarts.

``run_load`` fires every request at once at an SGLang-compatible ``/generate`` endpoint
(the real server or ``supervisor.sim.simulator``) and retries each one across restarts
(connection refused or reset, 5xx, timeouts) until it succeeds or the deadline passes.

The default mix (150 short prompts of 64 words, 32 long ones of 4000 words) is sized for
the simulator's seed profile: one 4000-token prefill alone needs ~1 GB of activations,
more than the 0.82 GB left at ``--mem-fraction-static 0.93``, while a full 8192-token
chunk (~2 GB) fits easily in the ~5.6 GB left at 0.88. So the same load kills the server
at 0.93 and completes at 0.88.

Run it by hand: ``python -m supervisor.sim.loadgen http://127.0.0.1:30000``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp

VOCAB = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load run achieved: requests that completed or failed, and how many tries it took."""

    completed: int
    failed: int
    attempts: int  # every try, first ones included
    retries: int  # attempts - requests
    elapsed_s: float


class _Retry(Exception):
    """An attempt that may succeed later: the server is restarting, overloaded or gone."""


def prompt(words: int, seed: int) -> str:
    """A prompt of exactly ``words`` whitespace-separated words (the simulator's tokens)."""
    return " ".join(VOCAB[(seed + i) % len(VOCAB)] for i in range(words))


async def _attempt(http: aiohttp.ClientSession, url: str, payload: dict[str, object], timeout_s: float) -> bool:
    """One try: True on success, False on a request the server will never accept (4xx)."""
    try:
        async with http.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status >= 500:
                raise _Retry(f"HTTP {resp.status}")
            await resp.read()
            return resp.status < 400
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
        raise _Retry(repr(exc)) from exc


async def run_load(
    base_url: str,
    *,
    short: int = 150,
    long: int = 32,
    short_words: int = 64,
    long_words: int = 4000,
    max_new_tokens: int = 16,
    deadline_s: float = 120,
    retry_interval_s: float = 0.5,
    request_timeout_s: float = 30.0,
) -> LoadResult:
    """Send ``short`` + ``long`` requests concurrently, each retried until done or the deadline."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + deadline_s
    url = base_url.rstrip("/") + "/generate"
    attempts = 0

    async def one(words: int, seed: int, http: aiohttp.ClientSession) -> bool:
        nonlocal attempts
        payload: dict[str, object] = {"text": prompt(words, seed), "sampling_params": {"max_new_tokens": max_new_tokens}}
        while (left := deadline - loop.time()) > 0:
            attempts += 1
            try:
                return await _attempt(http, url, payload, min(request_timeout_s, left))
            except _Retry:
                await asyncio.sleep(min(retry_interval_s, max(0.0, deadline - loop.time())))
        return False

    sizes = [short_words] * short + [long_words] * long
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
        results = await asyncio.gather(*(one(words, i, http) for i, words in enumerate(sizes)))
    completed = sum(results)
    return LoadResult(
        completed=completed,
        failed=len(results) - completed,
        attempts=attempts,
        retries=attempts - len(results),
        elapsed_s=loop.time() - started,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m supervisor.sim.loadgen URL [...]``: run the load, print the result as JSON."""
    p = argparse.ArgumentParser(prog="python -m supervisor.sim.loadgen", description=__doc__.splitlines()[0])
    p.add_argument("base_url")
    p.add_argument("--short", type=int, default=150)
    p.add_argument("--long", type=int, default=32)
    p.add_argument("--short-words", type=int, default=64)
    p.add_argument("--long-words", type=int, default=4000)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--deadline-s", type=float, default=120)
    a = p.parse_args(argv)
    result = asyncio.run(run_load(
        a.base_url, short=a.short, long=a.long, short_words=a.short_words, long_words=a.long_words,
        max_new_tokens=a.max_new_tokens, deadline_s=a.deadline_s,
    ))
    print(json.dumps(asdict(result)))
    return 0 if result.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
