"""Health probes: GET the server's /health with a hard deadline.

Healthy means "answered 200 within the timeout", not "the pid exists". SGLang's /health
runs a one-token generation (~1 s) and gives up itself after 20 s, so the default timeout
is above that. Garbage, a slow trickle or a huge body are a failed probe, never a stuck
loop: the whole exchange is bounded by the timeout and at most ``MAX_BODY`` bytes are read.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from supervisor.adapters.http import FreshSession
from supervisor.adapters.ports import ProbeOutcome

MAX_BODY = 64 * 1024


class HealthProber:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._http = FreshSession(timeout_s)  # a fresh connection per probe

    async def probe(self) -> ProbeOutcome:
        start = time.monotonic()
        status: int | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._http.session().get(self.url, allow_redirects=False) as resp:
                    status = resp.status
                    await resp.content.read(MAX_BODY)
            ok = status == 200
            detail = "ok" if ok else f"HTTP {status}"
        except TimeoutError:
            ok, detail = False, f"no answer within {self.timeout_s:g} s"
        except aiohttp.ClientConnectorError as exc:
            ok, detail = False, f"connection failed: {exc.os_error.strerror if exc.os_error else exc}"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            ok, detail = False, f"{type(exc).__name__}: {str(exc)[:200]}"
        return ProbeOutcome(ok, status, time.monotonic() - start, detail)

    async def aclose(self) -> None:
        await self._http.aclose()


# SGLang's own gauges (--enable-metrics; srt/observability/metrics_collector.py), one per
# label set (a data-parallel server has one per DP rank).
TOKEN_USAGE = b"sglang:token_usage"
QUEUE_REQS = b"sglang:num_queue_reqs"
MAX_METRICS_BODY = 4 * 1024 * 1024


class KvMetricsReader:
    """SGLang's KV-pool usage and queue from its ``/metrics`` (``--enable-metrics``).

    Only the two gauges' sample lines are read: SGLang's page holds dozens of histograms, and
    a full parse (prometheus_client's parser) every probe would cost more than the probe.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._http = FreshSession(timeout_s)

    async def read(self) -> tuple[float, int] | None:
        """(the highest token usage, the queued requests) or None when unreadable."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._http.session().get(self.url, allow_redirects=False) as resp:
                    if resp.status != 200:
                        return None
                    body = await resp.content.read(MAX_METRICS_BODY)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
        return parse_kv_gauges(body)

    async def aclose(self) -> None:
        await self._http.aclose()


def parse_kv_gauges(body: bytes) -> tuple[float, int] | None:
    usage: list[float] = []
    queue: list[float] = []
    for line in body.split(b"\n"):
        if line.startswith(TOKEN_USAGE):
            target = usage
        elif line.startswith(QUEUE_REQS):
            target = queue
        else:
            continue
        name_end = len(TOKEN_USAGE if target is usage else QUEUE_REQS)
        if line[name_end:name_end + 1] not in (b"{", b" "):
            continue  # another metric sharing the prefix
        try:
            target.append(float(line.rsplit(b" ", 1)[1]))
        except (IndexError, ValueError):
            continue
    if not usage:
        return None
    return max(usage), int(sum(queue))
