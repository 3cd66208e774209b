"""Health probes: GET the server's /health with a hard deadline.

Healthy means "answered 200 within the timeout", not "the pid exists". SGLang's /health
runs a one-token generation (~1 s) and gives up itself after 20 s, so the default timeout
is above that. Garbage, a slow trickle or a huge body are a failed probe, never a stuck
loop: the whole exchange is bounded by the timeout and at most ``MAX_BODY`` bytes are read.
"""

from __future__ import annotations

import time

from supervisor.adapters import http
from supervisor.adapters.ports import ProbeOutcome

MAX_BODY = 64 * 1024


class HealthProber:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._url = http.parse_url(url)

    async def probe(self) -> ProbeOutcome:
        """One GET on a fresh connection: healthy only for a 200 (a redirect is not followed);
        at most ``MAX_BODY`` bytes of its body are read."""
        start = time.monotonic()
        status: int | None = None
        try:
            status = (await http.request(self._url, timeout_s=self.timeout_s, max_body=MAX_BODY)).status
            ok = status == 200
            detail = "ok" if ok else f"HTTP {status}"
        except TimeoutError:
            ok, detail = False, f"no answer within {self.timeout_s:g} s"
        except http.ConnectError as exc:
            ok, detail = False, f"connection failed: {exc}"
        except http.HttpError as exc:
            ok, detail = False, str(exc)
        return ProbeOutcome(ok, status, time.monotonic() - start, detail)

    async def aclose(self) -> None:
        """Nothing is kept between probes; here for the ports' shape (a prober is closed)."""


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
        self._url = http.parse_url(url)

    async def read(self) -> tuple[float, int] | None:
        """(the highest token usage, the queued requests) or None when unreadable."""
        try:
            resp = await http.request(self._url, timeout_s=self.timeout_s, max_body=MAX_METRICS_BODY)
        except (TimeoutError, http.HttpError):
            return None
        return parse_kv_gauges(resp.body) if resp.status == 200 else None

    async def aclose(self) -> None:
        """Nothing is kept between reads."""


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
