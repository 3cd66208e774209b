"""SGLang's router, as the daemon drives it: list, add and remove workers over its HTTP API.

The router (``sglang-router`` 0.3.2, a Rust binary) keeps its worker list behind
``GET /workers``, ``POST /workers`` (``{"url": ...}`` -> 202 with a ``worker_id``) and
``DELETE /workers/<id>`` (202; the id, never the url). Both changes are queued: an added
worker is listed only once the router has reached it, so callers confirm with
``list_workers``. The facts, measured on the real binary, are in ``docs/router.md``.

Every call is bounded by ``timeout_s`` and every failure (refused, timed out, a non-2xx
answer, bad JSON, an answer of the wrong shape) is a ``RouterError`` whose ``str()`` is one
line naming the operation and the router's URL. The bearer token goes only into the
``Authorization`` header: it is never in a message, and is blanked out of the router's own
words should it echo it.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import quote, urlsplit

from supervisor.adapters import http
from supervisor.adapters.ports import RouterError, RouterWorker

MAX_BODY = 4 * 1024 * 1024  # the worker list of a big fleet fits; a runaway body does not
DETAIL_CHARS = 200


class RouterClient:
    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        try:
            base = http.parse_url(url)
        except ValueError:
            raise ValueError(f"router url must be http(s)://host[:port], got {_shown(url)!r}") from None
        self._base = base
        self._path = base.path.rstrip("/")  # a router mounted under a path keeps it
        self.url = base.base + self._path  # what messages name: no credentials, no query
        self._token = token or None
        self.timeout_s = timeout_s

    async def list_workers(self) -> list[RouterWorker]:
        op = "list workers"
        status, body = await self._call(op, "GET", "/workers")
        self._expect_2xx(op, status, body)
        data = self._json(op, status, body)
        items = data.get("workers") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise self._error(op, f'answer has no "workers" list: {_snippet(body)}', status)
        return [self._worker(op, status, item) for item in items]

    async def add(self, worker_url: str) -> str:
        """Queues the worker's addition; returns its id. A trailing ``/`` is dropped: 0.3.2
        would probe ``//health``, get a 404 and retry it for 30 minutes, never listing it."""
        worker_url = worker_url.rstrip("/")
        op = f"add worker {worker_url}"
        status, body = await self._call(op, "POST", "/workers", {"url": worker_url})
        self._expect_2xx(op, status, body)
        data = self._json(op, status, body)
        worker_id = data.get("worker_id") if isinstance(data, dict) else None
        if not isinstance(worker_id, str) or not worker_id:
            raise self._error(op, f'answer has no "worker_id": {_snippet(body)}', status)
        return worker_id

    async def remove(self, worker_id: str) -> None:
        op = f"remove worker {worker_id}"
        status, body = await self._call(op, "DELETE", "/workers/" + quote(worker_id, safe=""))
        if status == 404:  # not (or no longer) there: what removing wanted
            return
        self._expect_2xx(op, status, body)

    async def aclose(self) -> None:
        """Nothing is kept between calls (a fresh connection each)."""

    # -- one bounded exchange -------------------------------------------------------------

    async def _call(self, op: str, method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
        headers = [("Accept", "application/json")]
        if self._token:
            headers.append(("Authorization", f"Bearer {self._token}"))
        body = None
        if payload is not None:
            body = json.dumps(payload).encode()
            headers.append(("Content-Type", "application/json"))
        try:
            resp = await http.request(self._base.at(self._path + path), method, timeout_s=self.timeout_s, max_body=MAX_BODY,
                                      headers=tuple(headers), body=body)
        except TimeoutError:
            raise self._error(op, f"no answer within {self.timeout_s:g} s") from None
        except http.ConnectError as exc:
            raise self._error(op, f"cannot connect: {os.strerror(exc.errno) if exc.errno else exc}") from None
        except http.HttpError as exc:
            raise self._error(op, str(exc)) from None
        if not resp.complete:
            raise self._error(op, f"answer over {MAX_BODY} bytes", resp.status)
        return resp.status, resp.body

    def _expect_2xx(self, op: str, status: int, body: bytes) -> None:
        if not 200 <= status < 300:
            raise self._error(op, f"HTTP {status}" + (f": {_snippet(body)}" if body.strip() else ""), status)

    def _json(self, op: str, status: int, body: bytes) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise self._error(op, f"answer is not JSON: {_snippet(body)}", status) from None

    def _worker(self, op: str, status: int, item: Any) -> RouterWorker:
        if isinstance(item, dict):
            wid, url, healthy, load = item.get("id"), item.get("url"), item.get("is_healthy"), item.get("load")
            if isinstance(wid, str) and isinstance(url, str) and isinstance(healthy, bool):
                good_load = isinstance(load, int) and not isinstance(load, bool)
                return RouterWorker(id=wid, url=url, healthy=healthy, load=load if good_load else None)
        raise self._error(op, f"a worker without id, url and is_healthy: {_snippet(json.dumps(item))}", status)

    def _error(self, op: str, detail: str, status: int | None = None) -> RouterError:
        if self._token:
            detail = detail.replace(self._token, "<token>")
        return RouterError(http.one_line(f"router {self.url}: {op} failed: {detail}"), status=status)


def _snippet(body: bytes | str) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return http.one_line(text, DETAIL_CHARS)


def _shown(url: str) -> str:
    """``url`` without credentials, for the message of a refused one."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        return parts._replace(netloc=netloc).geturl()
    except ValueError:
        return "<unparsable>"
