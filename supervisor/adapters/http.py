"""The one way the adapters speak HTTP (aiohttp): a fresh connection per request, a total
deadline, bounded header lines. Shared by the health prober and the router client; the
adapters' independence contract (pyproject.toml) shares this module, ``output`` and ``ports``.
"""

from __future__ import annotations

import aiohttp


class FreshSession:
    """An ``aiohttp.ClientSession`` made on first use, with no keep-alive: a wedged or stale
    keep-alive socket (a server that hangs, a router restarted between two calls) must never
    fake an answer or cost a failed call. ``session()`` inside the event loop; ``aclose()``
    at the end (a later ``session()`` makes a new one)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=4),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                max_line_size=8190,
                max_field_size=8190,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
