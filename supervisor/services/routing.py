"""Keeping SGLang's router's view of our server true: logic over the ``Router`` port.

The core decides *when* (``RouterAdd`` once READY; ``RouterRemove`` first thing when the
server dies, and before every stop); this class carries it out against the router's worker
API (``adapters/router.py``, docs/router.md) and keeps it true afterwards:

- ``take_out`` removes the worker id we hold at once (one HTTP call: the router stops
  sending requests to a dying server within milliseconds, not after SGLang's own 5 s
  teardown or the router's 60 s health checks), then any other entry with our URL;
- ``run`` reconciles every ``[router] reconcile_s``: it adds the server when it should be
  in and is not (a router restarted, an add that failed), adopts an entry with our URL that
  it did not add, removes duplicates, and removes our URL when the server should be out.
  It never touches an entry with another URL. A failed call is reported
  (``router_call_failed``) and retried sooner, on the backoff; supervision never waits on it.

All our calls are serialised, so an add of ours cannot overtake a removal. The router's own
background jobs can (docs/router.md): an add is queued (202) and listed ~50 ms later, a
queued add cannot be cancelled, and re-adding a listed URL queues a registration that
undoes a removal. So the list is the truth, not the 202s: a URL that is listed is never
added again, an add not yet listed is given ``reconcile_s`` before it is tried again, and a
removal is checked again about a second later.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable

from supervisor.adapters.ports import Router, RouterError
from supervisor.aio import Backoff, Reconnect, within
from supervisor.core.events import Event, LinkDown, LinkUp, RouterCallFailed, RouterRegistered, RouterRemoved

RETRY_INITIAL_S = 0.5
RECHECK_S = 1.0  # after a removal: catch a registration job of the router's that undid it


def same_url(a: str, b: str) -> bool:
    return a.rstrip("/").lower() == b.rstrip("/").lower()


class RouterSync:
    def __init__(
        self,
        router: Router,
        worker_url: str,
        *,
        emit: Callable[[Event], None],
        reconcile_s: float,
        worker_id: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._router = router
        self.worker_url = worker_url
        self.worker_id = worker_id  # the id the router gave our server (kept in state.json)
        self._emit = emit
        self._reconcile_s = reconcile_s
        self._rng = rng or random.Random()
        self._want: bool | None = None  # None: not decided yet, our entries are left alone
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        # The router's outages: each failed call is a router_call_failed (counted by
        # operation) and waits the next step of the backoff; the outage itself is one
        # link_down when it begins and one link_up when a call is answered again.
        self._link = Reconnect(
            "router", Backoff(initial=RETRY_INITIAL_S, maximum=reconcile_s),
            on_down=lambda error: emit(LinkDown(link="router", error=str(error)[:300])),
            on_up=lambda down_s: None if down_s is None else emit(LinkUp(link="router", down_s=down_s)),
            rng=self._rng, clock=lambda: asyncio.get_running_loop().time(),
        )
        self._retry = 0.0  # the wait after the last failed call
        self._added_at: float | None = None  # loop time of our last add, until it is listed
        self._recheck = False

    @property
    def wanted(self) -> bool:
        return self._want is True

    def want_in(self, worker_url: str | None = None) -> None:
        """The server is READY (at ``worker_url``, the current config's): register it now
        (the loop does, at once)."""
        if worker_url is not None and not same_url(worker_url, self.worker_url) and self.worker_id is None:
            self.worker_url = worker_url  # a reload changed the port: this launch uses the new one
        self._want = True
        self._kick.set()

    async def take_out(self, reason: str, at: float) -> None:
        """Out of the router now; ``at`` (loop time) is when that was decided. What was
        removed is reported once (``router_removed``), even when a later call failed."""
        self._want = False
        self._recheck = True
        loop = asyncio.get_running_loop()
        async with self._lock:
            removed: list[str] = []
            after: float | None = None  # decision -> the router's answer to our first removal
            try:
                if self.worker_id is not None:
                    await self._router.remove(self.worker_id)
                    removed.append(self.worker_id)
                    self.worker_id = None
                after = round(loop.time() - at, 4)
                for worker in await self._router.list_workers():
                    if same_url(worker.url, self.worker_url):
                        await self._router.remove(worker.id)
                        removed.append(worker.id)
            except RouterError as exc:
                self._failed("remove", exc)
            else:
                self._link.connected()
            if removed:
                self._emit(RouterRemoved(worker_url=self.worker_url, worker_ids=tuple(removed), reason=reason,
                                         after_s=after if after is not None else round(loop.time() - at, 4)))

    async def routable(self) -> bool:
        """The router lists our server, healthy: it sends it requests now. A 202 to our add
        proves nothing (the add is queued), so a rolling restart asks this before it takes
        the next server out. A failed call is False, and not reported: nothing is changed."""
        return bool(self._want) and await self.listed_healthy()

    async def listed_healthy(self) -> bool:
        """The router lists our URL, healthy, whoever put it there (the server a killed
        daemon left, before it is replaced). A failed call is False."""
        async with self._lock:
            try:
                workers = await self._router.list_workers()
            except RouterError:
                return False
        return any(same_url(w.url, self.worker_url) and w.healthy for w in workers)

    async def reconcile(self) -> bool:
        """Make the router's entries for our URL what they should be; False when a call failed."""
        async with self._lock:
            op = "list"
            try:
                ours = [w for w in await self._router.list_workers() if same_url(w.url, self.worker_url)]
                now = asyncio.get_running_loop().time()
                if self._want is None:
                    extra = []  # not decided yet: what is listed is left alone
                elif self._want:
                    keep = next((w for w in ours if w.id == self.worker_id), ours[0] if ours else None)
                    if keep is not None:
                        self._added_at = None
                    pending = self._added_at is not None and now - self._added_at < self._reconcile_s
                    if keep is None and not pending:
                        op = "add"
                        self.worker_id = await self._router.add(self.worker_url)
                        self._added_at = now
                        self._emit(RouterRegistered(worker_url=self.worker_url, worker_id=self.worker_id))
                    elif keep is not None and keep.id != self.worker_id:
                        self.worker_id = keep.id
                        self._emit(RouterRegistered(worker_url=self.worker_url, worker_id=keep.id, adopted=True))
                    extra = [w.id for w in ours if keep is not None and w.id != keep.id]
                else:
                    self._added_at = None
                    extra = [w.id for w in ours]
                op = "remove"
                for worker_id in extra:
                    await self._router.remove(worker_id)
                if extra:
                    if not self._want:
                        self.worker_id = None
                    self._emit(RouterRemoved(worker_url=self.worker_url, worker_ids=tuple(extra),
                                             reason="reconcile", after_s=None))
            except RouterError as exc:
                self._failed(op, exc)
                return False
            self._link.connected()
            return True

    async def run(self) -> None:
        """Reconcile now, on every kick and every ``reconcile_s``; sooner after a failure."""
        delay = 0.0
        while True:
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await within(self._kick.wait(), delay)
            self._kick.clear()
            recheck, self._recheck = self._recheck, False
            ok = await self.reconcile()
            delay = self._retry if not ok else min(RECHECK_S, self._reconcile_s) if recheck else self._reconcile_s

    def _failed(self, op: str, exc: RouterError) -> None:
        self._retry = self._link.failed(exc)
        self._emit(RouterCallFailed(op=op, error=str(exc), retry_s=round(self._retry, 3)))
        if op == "remove":
            self._kick.set()  # the loop keeps removing it, on the backoff
