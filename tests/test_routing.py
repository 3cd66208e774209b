"""The router's view follows the server (``supervisor/services/routing.py``), on a fake router: in
once READY, out at once when it dies, never another URL touched, and a router that was down
or restarted is reconciled when it answers again."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest

from supervisor.adapters.ports import RouterError, RouterWorker
from supervisor.core.events import Event
from supervisor.services.routing import RouterSync

OURS = "http://127.0.0.1:30001"
OTHER = "http://127.0.0.1:30002"
DEADLINE_S = 10.0


class FakeRouter:
    """The worker API's behaviour: ids change on every add; ``down`` refuses every call."""

    def __init__(self) -> None:
        self.workers: dict[str, str] = {}  # id -> url
        self.down = False
        self.calls: list[tuple[str, str]] = []
        self._ids = itertools.count(1)
        self.remove_delay_s = 0.0

    def _check(self, op: str, arg: str = "") -> None:
        self.calls.append((op, arg))
        if self.down:
            raise RouterError(f"router {op} at http://127.0.0.1:30080: connection refused")

    async def list_workers(self) -> list[RouterWorker]:
        self._check("list")
        return [RouterWorker(id=i, url=u, healthy=True) for i, u in self.workers.items()]

    async def add(self, worker_url: str) -> str:
        self._check("add", worker_url)
        worker_id = f"w{next(self._ids)}"
        self.workers[worker_id] = worker_url
        return worker_id

    async def remove(self, worker_id: str) -> None:
        self._check("remove", worker_id)
        await asyncio.sleep(self.remove_delay_s)
        self.workers.pop(worker_id, None)

    async def aclose(self) -> None: ...

    def urls(self) -> list[str]:
        return sorted(self.workers.values())


class Events:
    def __init__(self) -> None:
        self.seen: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.seen.append(event)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.seen]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e.fields() for e in self.seen if e.kind == kind]


def make(router: FakeRouter, events: Events, **kw: Any) -> RouterSync:
    return RouterSync(router, OURS, emit=events, reconcile_s=kw.pop("reconcile_s", 0.05), rng=random.Random(0), **kw)


async def until(predicate: Any, what: str) -> None:
    while not predicate():
        await asyncio.sleep(0.002)


async def test_in_once_ready_and_out_at_once_with_the_known_id_first() -> None:
    async with asyncio.timeout(DEADLINE_S):
        router, events = FakeRouter(), Events()
        router.workers["x1"] = OTHER  # another server's entry: never touched
        sync = make(router, events)
        task = asyncio.create_task(sync.run())
        sync.want_in()
        await until(lambda: OURS in router.urls(), "registered")
        assert events.of("router_registered") == [{"worker_url": OURS, "worker_id": sync.worker_id, "adopted": False}]
        router.calls.clear()
        at = asyncio.get_running_loop().time()
        await sync.take_out("scheduler_TP0 died", at)
        assert router.calls[0] == ("remove", "w1")  # the id we hold, before anything else
        assert router.urls() == [OTHER]
        (removed,) = events.of("router_removed")
        assert removed["worker_ids"] == ["w1"] and removed["reason"] == "scheduler_TP0 died"
        assert 0 <= removed["after_s"] < 1.0
        await asyncio.sleep(0.15)  # a few reconciles: it stays out, the other stays in
        assert router.urls() == [OTHER] and ("remove", "x1") not in router.calls
        task.cancel()


async def test_entries_of_ours_are_left_alone_until_the_core_decides_then_removed_and_others_kept() -> None:
    """At start our URL may be the server a killed daemon left, still serving: nothing is
    removed until the unit takes it out (when it is replaced), and then only ours."""
    async with asyncio.timeout(DEADLINE_S):
        router, events = FakeRouter(), Events()
        router.workers.update({"old1": OURS, "old2": OURS + "/", "x1": OTHER})
        sync = make(router, events, worker_id="old1")
        assert await sync.reconcile()
        assert sorted(router.workers) == ["old1", "old2", "x1"] and not events.of("router_removed")
        assert await sync.listed_healthy() and not await sync.routable()  # listed, but not ours to route yet
        await sync.take_out("replacing the server the last daemon left", 0.0)
        assert await sync.reconcile()
        assert router.urls() == [OTHER]
        assert events.of("router_removed")[0]["worker_ids"] == ["old1", "old2"]
        assert sync.worker_id is None


async def test_an_entry_of_ours_is_adopted_and_duplicates_removed() -> None:
    async with asyncio.timeout(DEADLINE_S):
        router, events = FakeRouter(), Events()
        router.workers.update({"a": OURS, "b": OURS})
        sync = make(router, events)
        sync.want_in()
        assert await sync.reconcile()
        assert list(router.workers) == ["a"] and not [c for c in router.calls if c[0] == "add"]
        assert events.of("router_registered") == [{"worker_url": OURS, "worker_id": "a", "adopted": True}]


async def test_a_router_that_was_down_or_restarted_is_reconciled_when_it_answers() -> None:
    """Calls to a down router fail, are reported and retried on the backoff; supervision
    never waits. Once it answers the server is registered; after a router restart (all
    entries gone) it is registered again."""
    async with asyncio.timeout(DEADLINE_S):
        router, events = FakeRouter(), Events()
        router.down = True
        sync = make(router, events, reconcile_s=0.2)
        task = asyncio.create_task(sync.run())
        sync.want_in()
        await until(lambda: len(events.of("router_call_failed")) >= 3, "failures, retried")
        assert all(f["retry_s"] <= 0.2 for f in events.of("router_call_failed"))
        router.down = False
        await until(lambda: OURS in router.urls(), "registered once the router answers")
        router.workers.clear()  # the router restarted and forgot us
        await until(lambda: OURS in router.urls(), "registered again after the router restart")
        assert len(events.of("router_registered")) == 2
        task.cancel()


async def test_a_removal_while_the_router_is_down_is_finished_when_it_is_back() -> None:
    async with asyncio.timeout(DEADLINE_S):
        router, events = FakeRouter(), Events()
        sync = make(router, events)
        task = asyncio.create_task(sync.run())
        sync.want_in()
        await until(lambda: OURS in router.urls(), "registered")
        router.down = True
        await sync.take_out("server died", asyncio.get_running_loop().time())
        assert events.of("router_call_failed")[-1]["op"] == "remove"
        router.down = False
        await until(lambda: OURS not in router.urls(), "removed once the router answers")
        task.cancel()


async def test_an_add_never_overtakes_a_removal() -> None:
    """READY then dead at once: the calls are serialised, so the server ends out."""
    async with asyncio.timeout(DEADLINE_S):
        router, events = FakeRouter(), Events()
        sync = make(router, events)
        task = asyncio.create_task(sync.run())
        sync.want_in()
        removal = asyncio.create_task(sync.take_out("died", asyncio.get_running_loop().time()))
        await removal
        await asyncio.sleep(0.15)
        assert OURS not in router.urls()
        task.cancel()


@pytest.mark.parametrize("op", ["list", "add"])
async def test_failures_name_the_operation(op: str) -> None:
    router, events = FakeRouter(), Events()
    sync = make(router, events)
    sync.want_in()
    if op == "add":
        original = router.add

        async def refuse(url: str) -> str:
            raise RouterError("router add at http://127.0.0.1:30080: HTTP 503")

        router.add = refuse  # type: ignore[method-assign]
    else:
        router.down = True
    assert not await sync.reconcile()
    assert events.of("router_call_failed")[0]["op"] == op
    if op == "add":
        router.add = original  # type: ignore[method-assign]


async def test_an_add_the_router_has_not_listed_yet_is_not_sent_again() -> None:
    """The router lists a worker ~50 ms after its 202 (a queued job); re-adding a URL it is
    registering queues another job that would undo a later removal (docs/router.md). So an
    add not yet listed is left alone for ``reconcile_s``."""
    async with asyncio.timeout(DEADLINE_S):
        router, events = FakeRouter(), Events()
        queued: dict[str, str] = {}
        original_add = router.add

        async def queued_add(worker_url: str) -> str:
            worker_id = await original_add(worker_url)
            queued[worker_id] = router.workers.pop(worker_id)  # accepted, not listed yet
            return worker_id

        router.add = queued_add  # type: ignore[method-assign]
        sync = make(router, events, reconcile_s=5.0)
        sync.want_in()
        assert await sync.reconcile() and await sync.reconcile() and await sync.reconcile()
        assert [c for c in router.calls if c[0] == "add"] == [("add", OURS)]
        router.workers.update(queued)  # the job is done: listed under the id it gave
        assert await sync.reconcile()
        assert sync.worker_id == "w1" and len(events.of("router_registered")) == 1


async def test_routable_only_once_the_router_lists_our_server_healthy() -> None:
    """A rolling restart takes the next server out only once this one gets requests: listed
    and healthy, not merely added (the router queues an add; its 202 proves nothing)."""
    async with asyncio.timeout(DEADLINE_S):
        router, events = FakeRouter(), Events()
        sync = make(router, events)
        assert not await sync.routable()  # not wanted in
        sync.want_in()
        assert not await sync.routable()  # wanted, not yet listed
        router.workers["w9"] = OTHER
        assert not await sync.routable()  # another URL listed is not ours
        await sync.reconcile()
        assert router.urls() == [OURS, OTHER]
        unhealthy = router.list_workers

        async def listed_unhealthy() -> list[RouterWorker]:
            return [RouterWorker(id=w.id, url=w.url, healthy=False) for w in await unhealthy()]

        router.list_workers = listed_unhealthy  # type: ignore[method-assign]
        assert not await sync.routable()  # listed, but the router does not send it requests
        router.list_workers = unhealthy  # type: ignore[method-assign]
        assert await sync.routable()
        router.down = True
        assert not await sync.routable()  # cannot tell: not routable, and nothing reported
        assert events.kinds() == ["router_registered"]


def test_an_outage_of_the_router_is_one_link_down_and_one_link_up_however_many_calls_failed() -> None:
    """Every failed call is a router_call_failed that waits the next, growing step of the
    backoff; the outage is one link_down at its first failure and one link_up, with its
    length, at the first answer (a first answer with no outage before is no event). The next
    outage backs off from the start again."""
    async def scenario() -> tuple[list[str], list[float], list[float]]:
        router, events = FakeRouter(), Events()
        sync = make(router, events, reconcile_s=8.0)
        sync.want_in()
        assert await sync.reconcile()  # the first answer
        router.down = True
        for _ in range(4):
            assert not await sync.reconcile()
        first = [f["retry_s"] for f in events.of("router_call_failed")]
        router.down = False
        assert await sync.reconcile()
        router.down = True
        assert not await sync.reconcile()
        again = [f["retry_s"] for f in events.of("router_call_failed")][4:]
        downs = [e.fields()["down_s"] for e in events.seen if e.kind == "link_up"]
        return [k for k in events.kinds() if k.startswith("link")], first + again, downs

    kinds, waits, downs = asyncio.run(scenario())
    assert kinds == ["link_down", "link_up", "link_down"]
    assert len(downs) == 1 and downs[0] >= 0
    # jittered to [d/2, d] of 0.5, 1, 2, 4, then 0.5 again after the good answer
    assert [0.25 <= w <= 0.5 for w in (waits[0], waits[4])] == [True, True]
    assert 2.0 <= waits[3] <= 4.0
