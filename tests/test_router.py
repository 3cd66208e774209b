"""The router adapter (supervisor.adapters.router) against the REAL SGLang router.

The router is ``sglang-router`` 0.3.2 from the [test] extra (``python -m
sglang_router.launch_router``), started on free ports and always reaped; its workers are our
simulator. Without the package these tests fail, naming it: they never skip. What the tests
pin about the router's API is written down in docs/router.md.

The token and the bad-answer cases use a tiny aiohttp server in the test process instead: it
can record headers and answer anything.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from conftest import free_port

from supervisor.adapters.ports import RouterError, RouterWorker
from supervisor.adapters.router import RouterClient
from tests.routerlib import Proc

TOKEN = "s3cret-Token-4242"


@pytest.fixture
def start_worker(tmp_path: Path, no_leftovers: str) -> Iterator[Callable[[], tuple[str, Proc]]]:
    """Starts simulated SGLang servers; returns each one's URL and process."""
    procs: list[Proc] = []

    def start() -> tuple[str, Proc]:
        port = free_port()
        argv = [sys.executable, "-m", "supervisor.sim.simulator", "--model-path", "/models/router-test",
                "--port", str(port), "--sim-load-s", "0.2", "--sim-gpu-dir", str(tmp_path / f"gpus-{port}")]
        proc = Proc(argv, tmp_path / f"worker-{port}.log")
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(url + "/health", "the simulator")
        return url, proc

    yield start
    for p in procs:
        p.stop()


async def wait_listed(client: RouterClient, pred: Callable[[list[RouterWorker]], Any], what: str,
                      timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        workers = await client.list_workers()
        if value := pred(workers):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; listed: {workers}")
        await asyncio.sleep(0.05)


def by_id(wid: str) -> Callable[[list[RouterWorker]], RouterWorker | None]:
    return lambda workers: next((w for w in workers if w.id == wid), None)


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and text.strip() == text and text, repr(text)
    return text


# --- the real router ----------------------------------------------------------------------


@pytest.mark.integration
async def test_add_list_remove_readd(start_router: Callable[..., str],
                                     start_worker: Callable[[], tuple[str, Proc]]) -> None:
    router_url = await asyncio.to_thread(start_router)
    worker_url, worker = await asyncio.to_thread(start_worker)
    client = RouterClient(router_url, None, timeout_s=5.0)
    try:
        assert await client.list_workers() == []

        # Nobody listens there: accepted (an id) but never listed; the router retries it alone.
        ghost_id = await client.add(f"http://127.0.0.1:{free_port()}")

        wid = await client.add(worker_url)
        uuid.UUID(wid)  # the router's ids are UUIDs
        # Listed first, then healthy once the router's own health check of it passes (under
        # load it was seen listed and not yet healthy): wait for both.
        listed = await wait_listed(client, lambda ws: (w := by_id(wid)(ws)) is not None and w.healthy and w,
                                   "the added worker, healthy")
        assert listed == RouterWorker(id=wid, url=worker_url, healthy=True, load=0)
        assert [w.id for w in await client.list_workers()] == [wid]  # the ghost is not listed
        assert ghost_id != wid

        # Before listing it the router read the worker's /health, /server_info and /model_info.
        access = worker.text()
        for path in ("/health", "/server_info", "/model_info"):
            assert f'"GET {path} HTTP/1.1" 200' in access, f"the router never asked {path}:\n{access[-2000:]}"

        await client.remove(wid)
        await wait_listed(client, lambda ws: not ws, "the removed worker to go")
        await client.remove(wid)  # unknown now (404): counts as removed
        await client.remove(str(uuid.uuid4()))
        with pytest.raises(RouterError) as bad:
            await client.remove("not-a-uuid")  # the router wants ids, not urls or names
        assert bad.value.status == 400
        assert router_url in one_line(bad.value)

        again = await client.add(worker_url)
        assert again != wid  # a new id every time it is added again
        assert (await wait_listed(client, by_id(again), "the re-added worker")).url == worker_url
        assert [w.id for w in await client.list_workers()] == [again]

        # Adding a listed url again is answered with the id it has, and lists no second entry.
        # (It still queues a registration: a remove sent before that job ends is undone, the
        # worker coming back under a new id; docs/router.md. So this comes last.)
        assert await client.add(worker_url) == again
        await asyncio.sleep(0.3)
        assert [w.id for w in await client.list_workers()] == [again]
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_real_router_takes_the_token_as_bearer(start_router: Callable[..., str]) -> None:
    router_url = await asyncio.to_thread(start_router, "--control-plane-api-keys", f"sup:supervisor:admin:{TOKEN}")
    good = RouterClient(router_url, TOKEN, timeout_s=5.0)
    wrong = RouterClient(router_url, TOKEN + "-wrong", timeout_s=5.0)
    none = RouterClient(router_url, None, timeout_s=5.0)
    try:
        assert await good.list_workers() == []
        await good.remove(str(uuid.uuid4()))
        for client in (wrong, none):
            with pytest.raises(RouterError) as exc:
                await client.list_workers()
            assert exc.value.status == 401
            text = one_line(exc.value)
            assert "list workers" in text and router_url in text and "HTTP 401" in text
            assert TOKEN not in text and TOKEN not in repr(exc.value)
    finally:
        for client in (good, wrong, none):
            await client.aclose()


# --- a router that is down or mute (no process) --------------------------------------------


async def test_router_down_fails_fast_with_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    client = RouterClient(url, TOKEN, timeout_s=5.0)
    calls = {"list workers": client.list_workers, "add worker": lambda: client.add("http://127.0.0.1:9"),
             "remove worker": lambda: client.remove(str(uuid.uuid4()))}
    try:
        for op, call in calls.items():
            start = time.monotonic()
            with pytest.raises(RouterError) as exc:
                await call()
            assert time.monotonic() - start < 2.0
            text = one_line(exc.value)
            assert op in text and url in text and "refused" in text.lower(), text
            assert TOKEN not in text and exc.value.status is None
    finally:
        await client.aclose()


async def test_mute_router_is_bounded_by_the_timeout() -> None:
    with socket.socket() as hole:  # accepts (the kernel's backlog), never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        client = RouterClient(url, TOKEN, timeout_s=0.3)
        try:
            for call in (client.list_workers, lambda: client.add("http://127.0.0.1:9"), lambda: client.remove("x")):
                start = time.monotonic()
                with pytest.raises(RouterError) as exc:
                    await call()
                assert 0.25 < time.monotonic() - start < 1.5
                text = one_line(exc.value)
                assert "no answer within 0.3 s" in text and url in text and TOKEN not in text
        finally:
            await client.aclose()


# --- a fake router that records and answers anything (in this process) ---------------------


class Fake:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []  # method, raw path, Authorization
        self.answers: dict[tuple[str, str], tuple[int, str]] = {}
        self.bodies: list[bytes] = []

    async def handle(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        self.seen.append((request.method, request.raw_path, auth))
        self.bodies.append(await request.read())
        status, body = self.answers.get((request.method, request.path), (404, ""))
        return web.Response(status=status, text=body.replace("{auth}", auth or ""), content_type="application/json")


@asynccontextmanager
async def fake_router() -> AsyncIterator[tuple[Fake, str]]:
    fake = Fake()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


WORKERS = {"workers": [
    {"id": "a", "url": "http://w1:30000", "is_healthy": True, "load": 3, "model_id": "m"},
    {"id": "b", "url": "http://w2:30000", "is_healthy": False},  # no load: None
    {"id": "c", "url": "http://w3:30000", "is_healthy": True, "load": "busy"},
], "total": 3}


async def test_token_is_a_bearer_header_and_never_in_error_text() -> None:
    async with fake_router() as (fake, url):
        fake.answers = {
            ("GET", "/workers"): (200, json.dumps(WORKERS)),
            ("POST", "/workers"): (500, 'multi\nline error: you sent "{auth}"'),  # a router that echoes it
            ("DELETE", f"/workers/{'x' * 8}"): (401, "{auth} is not a valid token"),
        }
        client = RouterClient(url + "/", TOKEN, timeout_s=2.0)
        try:
            assert await client.list_workers() == [
                RouterWorker("a", "http://w1:30000", True, 3),
                RouterWorker("b", "http://w2:30000", False, None),
                RouterWorker("c", "http://w3:30000", True, None),
            ]
            for call, op, status in ((lambda: client.add("http://w4:1"), "add worker http://w4:1", 500),
                                     (lambda: client.remove("x" * 8), "remove worker xxxxxxxx", 401)):
                with pytest.raises(RouterError) as exc:
                    await call()
                text = one_line(exc.value)
                assert op in text and url in text and f"HTTP {status}" in text, text
                assert exc.value.status == status
                assert TOKEN not in text and TOKEN not in repr(exc.value.args), text
        finally:
            await client.aclose()
        assert {auth for _, _, auth in fake.seen} == {f"Bearer {TOKEN}"}
        assert [(m, p) for m, p, _ in fake.seen] == [("GET", "/workers"), ("POST", "/workers"),
                                                      ("DELETE", "/workers/xxxxxxxx")]

        plain = RouterClient(url, None, timeout_s=2.0)
        try:
            await plain.list_workers()
        finally:
            await plain.aclose()
        assert fake.seen[-1][2] is None  # no token: no header


@pytest.mark.parametrize(("method", "answer", "complaint"), [
    ("list", (200, "<html>\n<body>proxy</body>\n</html>"), "not JSON"),
    ("list", (200, '{"items": []}'), 'no "workers" list'),
    ("list", (200, '{"workers": [{"id": "a", "url": "http://w"}]}'), "without id, url and is_healthy"),
    ("list", (502, "bad\ngateway"), "HTTP 502: bad gateway"),
    ("add", (202, '{"status": "accepted"}'), 'no "worker_id"'),
    ("add", (202, "accepted"), "not JSON"),
    ("add", (404, ""), "HTTP 404"),  # 0.3.2 answers 404 to the old /add_worker; a 404 here is no success
    ("remove", (500, "{}"), "HTTP 500"),
])
async def test_bad_answers_are_one_line_router_errors(method: str, answer: tuple[int, str], complaint: str) -> None:
    key = {"list": ("GET", "/workers"), "add": ("POST", "/workers"), "remove": ("DELETE", "/workers/w1")}[method]
    async with fake_router() as (fake, url):
        fake.answers = {key: answer}
        client = RouterClient(url, None, timeout_s=2.0)
        try:
            call = {"list": client.list_workers, "add": lambda: client.add("http://w1"),
                    "remove": lambda: client.remove("w1")}[method]
            with pytest.raises(RouterError) as exc:
                await call()
            text = one_line(exc.value)
            assert complaint in text and url in text, text
        finally:
            await client.aclose()


async def test_add_posts_the_url_without_a_trailing_slash() -> None:
    async with fake_router() as (fake, url):
        fake.answers = {("POST", "/workers"): (202, '{"status": "accepted", "worker_id": "w-1"}')}
        client = RouterClient(url, None, timeout_s=2.0)
        try:
            assert await client.add("http://10.0.0.7:30000/") == "w-1"
        finally:
            await client.aclose()
        assert json.loads(fake.bodies[0]) == {"url": "http://10.0.0.7:30000"}  # 0.3.2 never lists "...:30000/"


async def test_remove_of_an_unknown_id_is_no_error_and_ids_are_quoted() -> None:
    async with fake_router() as (fake, url):
        client = RouterClient(url, None, timeout_s=2.0)
        try:
            await client.remove("../add_worker?url=x")  # 404 from the fake: counts as removed
        finally:
            await client.aclose()
        assert fake.seen[0][:2] == ("DELETE", "/workers/..%2Fadd_worker%3Furl%3Dx")  # one path segment


def test_credentials_in_the_url_are_never_shown() -> None:
    client = RouterClient("http://admin:pw@127.0.0.1:1", None, timeout_s=1.0)
    assert client.url == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="http"):
        RouterClient("unix:///run/router.sock", None, timeout_s=1.0)
