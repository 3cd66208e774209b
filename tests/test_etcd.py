"""The etcd adapter against a real etcd 3.4 (tests/etcdlib.py): leases, compare-and-swap,
watches, the election, and what an outage looks like to the daemon.

TTLs are 2-3 s here to keep the file short (etcd's floor is 2 s at its default tick); the
daemon itself uses 10 s or more.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from supervisor.adapters.etcd import EtcdClient, EtcdError, parse_endpoint
from tests import etcdlib
from tests.conftest import free_port
from tests.etcdlib import EtcdServer, etcd_binary, etcd_server  # noqa: F401 - a fixture
from tests.mosquitto import make_tls_files

pytestmark = pytest.mark.integration
TIMEOUT_S = 2.0


@pytest.fixture
async def client(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:  # noqa: F811
    c = EtcdClient([etcd_server.endpoint], timeout_s=TIMEOUT_S)
    await c.connect()
    yield c
    await c.aclose()


async def eventually(check, timeout: float, what: str):  # noqa: ANN001, ANN201
    """Awaits ``check()`` until it returns a truthy value; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(EtcdError):
            if value := await check():
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.1)


async def stop_task(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, EtcdError):
        await task


# -- leases ----------------------------------------------------------------------------------


async def test_a_leased_key_lives_while_kept_alive_and_goes_one_ttl_after_keep_alive_stops(client: EtcdClient) -> None:
    """A key on a 2 s lease outlives its TTL while the keep-alive task runs, and etcd
    deletes it within about a TTL once the task stops."""
    lease = await client.grant(2)
    assert lease.ttl_s == 2
    await client.put("/t/nodes/0", b"alive", lease=lease)
    keeper = asyncio.create_task(client.keep_alive(lease))
    await asyncio.sleep(3.0)
    assert not keeper.done()
    kv = await client.get("/t/nodes/0")
    assert kv is not None and kv.value == b"alive" and kv.lease == lease.id

    await stop_task(keeper)
    stopped = time.monotonic()
    await eventually(lambda: _absent(client, "/t/nodes/0"), timeout=6.0, what="the leased key to expire")
    assert time.monotonic() - stopped < 4.5  # TTL 2 s + etcd's 0.5 s expiry sweep + slack


async def _absent(client: EtcdClient, key: str) -> bool:
    return await client.get(key) is None


async def test_revoke_deletes_the_keys_at_once_and_a_second_revoke_is_no_error(client: EtcdClient) -> None:
    lease = await client.grant(30)
    await client.put_all({"/t/a": b"1", "/t/b": b"2"}, lease=lease)
    await client.revoke(lease)
    assert (await client.get_prefix("/t/"))[0] == []
    await client.revoke(lease)


async def test_keep_alive_raises_at_once_for_a_lease_etcd_no_longer_has(client: EtcdClient) -> None:
    lease = await client.grant(5)
    await client.revoke(lease)
    with pytest.raises(EtcdError, match="expired"):
        await asyncio.wait_for(client.keep_alive(lease), 5)


# -- keys and transactions -------------------------------------------------------------------


async def test_put_if_writes_only_over_the_revision_it_read(client: EtcdClient) -> None:
    """Compare-and-swap: "only if absent" wins once; a write over a stale mod_revision loses
    and changes nothing; one over the current mod_revision wins."""
    first = await client.put_if("/t/gen", b"1", mod_revision=0)
    assert first is not None
    assert await client.put_if("/t/gen", b"other", mod_revision=0) is None

    kv = await client.get("/t/gen")
    assert kv is not None and (kv.value, kv.create_revision, kv.mod_revision) == (b"1", first, first)
    second = await client.put_if("/t/gen", b"2", mod_revision=first)
    assert second is not None and second > first
    assert await client.put_if("/t/gen", b"stale", mod_revision=first) is None
    kv = await client.get("/t/gen")
    assert kv is not None and (kv.value, kv.create_revision, kv.mod_revision) == (b"2", first, second)


async def test_put_all_writes_every_key_at_one_revision_or_none(client: EtcdClient) -> None:
    """The leader's generation: all keys in one transaction, guarded by its own key."""
    guard = await client.put("/t/leader", b"me")
    rev = await client.put_all({"/t/gen/fraction": b"0.85", "/t/gen/hicache": b"0"}, expect={"/t/leader": guard})
    kvs, _ = await client.get_prefix("/t/gen/")
    assert [(kv.key, kv.value, kv.mod_revision) for kv in kvs] == [
        ("/t/gen/fraction", b"0.85", rev), ("/t/gen/hicache", b"0", rev)]

    await client.put("/t/leader", b"someone else")
    assert await client.put_all({"/t/gen/fraction": b"0.80", "/t/gen/new": b"x"}, expect={"/t/leader": guard}) is None
    kvs, _ = await client.get_prefix("/t/gen/")
    assert [(kv.key, kv.value) for kv in kvs] == [("/t/gen/fraction", b"0.85"), ("/t/gen/hicache", b"0")]


async def test_get_prefix_stops_at_the_prefix_and_delete_prefix_counts(client: EtcdClient) -> None:
    for key in ("/t/a/1", "/t/a/2", "/t/ab", "/t/b"):
        await client.put(key, b"v")
    kvs, revision = await client.get_prefix("/t/a/")
    assert [kv.key for kv in kvs] == ["/t/a/1", "/t/a/2"]
    assert revision >= max(kv.mod_revision for kv in kvs)
    assert await client.delete_prefix("/t/a/") == 2
    assert await client.delete("/t/ab") is True
    assert await client.delete("/t/ab") is False
    assert [kv.key for kv in (await client.get_prefix("/t/"))[0]] == ["/t/b"]


# -- watches ---------------------------------------------------------------------------------


async def test_a_watch_from_a_revision_sees_every_put_and_delete_in_order(client: EtcdClient) -> None:
    """List, then watch from one past the list's revision: the changes made in between and
    those made while watching come in order, each with the revision its write returned."""
    _, listed = await client.get_prefix("/t/")
    revs = [await client.put("/t/n/0", b"a"), await client.put("/t/n/1", b"b")]
    await client.delete("/t/n/0")
    revs.append(await client.put("/t/other", b"not under the prefix") - 1)  # one write after the delete
    seen = []
    watch = client.watch_prefix("/t/n/", start_revision=listed + 1)
    async with asyncio.timeout(10):
        async for ev in watch:
            seen.append(ev)
            if len(seen) == 3:  # caught up: now a live change
                revs.append(await client.put("/t/n/1", b"c"))
            if len(seen) == 4:
                break
    await watch.aclose()  # type: ignore[attr-defined]
    assert [(e.kind, e.key, e.value) for e in seen] == [
        ("put", "/t/n/0", b"a"), ("put", "/t/n/1", b"b"), ("delete", "/t/n/0", b""), ("put", "/t/n/1", b"c")]
    assert [e.revision for e in seen] == revs


async def test_a_watch_ends_with_an_error_when_etcd_stops(etcd_server: EtcdServer, client: EtcdClient) -> None:  # noqa: F811
    watch = client.watch_prefix("/t/")
    got = asyncio.create_task(anext(watch))  # type: ignore[arg-type]
    await asyncio.sleep(0.5)  # the watch is established
    await asyncio.to_thread(etcd_server.stop)
    with pytest.raises(EtcdError, match="watch /t/"):
        await asyncio.wait_for(got, 20)


# -- the election ----------------------------------------------------------------------------


async def test_one_of_two_candidates_leads_and_the_other_takes_over_when_its_lease_ends(
    etcd_server: EtcdServer,  # noqa: F811
) -> None:
    """etcd's election recipe: the first candidate leads; the second waits, and leads once
    the first one's lease is revoked (its key deleted), not before."""
    a = EtcdClient([etcd_server.endpoint], timeout_s=TIMEOUT_S)
    b = EtcdClient([etcd_server.endpoint], timeout_s=TIMEOUT_S)
    try:
        lease_a, lease_b = await a.grant(10), await b.grant(10)
        won_a = await asyncio.wait_for(a.campaign("/t/election", lease_a, b"node-a"), 5)
        assert won_a.key == f"/t/election/{lease_a.id:x}"
        campaign_b = asyncio.create_task(b.campaign("/t/election", lease_b, b"node-b"))
        await asyncio.sleep(1.0)
        assert not campaign_b.done(), "b was elected while a still leads"
        leader = await b.leader("/t/election")
        assert leader is not None and leader.value == b"node-a" and leader.create_revision == won_a.revision

        await a.revoke(lease_a)
        won_b = await asyncio.wait_for(campaign_b, 5)
        assert won_b.revision > won_a.revision
        leader = await a.leader("/t/election")
        assert leader is not None and (leader.key, leader.value) == (won_b.key, b"node-b")

        await b.resign(won_b)
        assert await a.leader("/t/election") is None
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_third_candidate_waits_for_the_one_just_before_it(client: EtcdClient) -> None:
    """Three in line: when the middle one withdraws, the last still waits for the leader."""
    leases = [await client.grant(10) for _ in range(3)]
    first = await client.campaign("/t/el", leases[0])
    second = asyncio.create_task(client.campaign("/t/el", leases[1]))
    await asyncio.sleep(0.3)
    third = asyncio.create_task(client.campaign("/t/el", leases[2]))
    await asyncio.sleep(0.5)
    await stop_task(second)  # a cancelled campaign withdraws its key
    assert [kv.key for kv in (await client.get_prefix("/t/el/"))[0]] == sorted(
        [first.key, f"/t/el/{leases[2].id:x}"])
    await asyncio.sleep(0.5)
    assert not third.done()
    await client.resign(first)
    won = await asyncio.wait_for(third, 5)
    assert (await client.leader("/t/el")).key == won.key  # type: ignore[union-attr]


# -- outages and bad endpoints ---------------------------------------------------------------


async def test_etcd_stopped_raises_within_the_timeout_and_works_again_once_back(
    etcd_server: EtcdServer, client: EtcdClient,  # noqa: F811
) -> None:
    """An outage is an EtcdError (one line, within the timeout) for every call, a lease is
    reported lost once a whole TTL passed unrefreshed, and the same client works again as
    soon as etcd is back, with its data."""
    await client.put("/t/kept", b"1")
    lease = await client.grant(2)
    keeper = asyncio.create_task(client.keep_alive(lease))
    await asyncio.to_thread(etcd_server.stop)

    for call in (client.get("/t/kept"), client.put("/t/x", b"1"), client.grant(5)):
        started = time.monotonic()
        with pytest.raises(EtcdError) as caught:
            await call
        assert time.monotonic() - started < TIMEOUT_S + 1.5
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"etcd {etcd_server.endpoint}: ")

    with pytest.raises(EtcdError, match="lost"):
        await asyncio.wait_for(keeper, 10)

    await asyncio.to_thread(etcd_server.start)
    kv = await eventually(lambda: client.get("/t/kept"), timeout=10, what="the client to reach etcd again")
    assert kv.value == b"1"


async def test_connect_fails_within_the_timeout_when_nothing_listens_or_nothing_answers() -> None:
    """A refused port and a listener that never speaks (a black hole) both fail the connect
    within its timeout, and the message names the endpoint."""
    refused = free_port()
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        for port in (refused, hole.getsockname()[1]):
            c = EtcdClient([f"127.0.0.1:{port}"], timeout_s=1.0)
            started = time.monotonic()
            with pytest.raises(EtcdError, match=rf"^etcd http://127\.0\.0\.1:{port}: connect failed: "):
                await c.connect()
            assert time.monotonic() - started < 2.5
            await c.aclose()


async def test_the_first_endpoint_that_answers_is_used(etcd_server: EtcdServer) -> None:  # noqa: F811
    c = EtcdClient([f"127.0.0.1:{free_port()}", etcd_server.endpoint], timeout_s=TIMEOUT_S)
    try:
        await c.put("/t/k", b"v")
        assert c.endpoint == etcd_server.endpoint
    finally:
        await c.aclose()


async def test_tls_with_a_client_certificate(tmp_path: Path, no_leftovers: str) -> None:
    """etcd serving TLS and asking for a client certificate: the CA and our certificate get
    in; without the certificate the connect fails with one line, within the timeout."""
    tls = make_tls_files(tmp_path / "tls")
    server = EtcdServer(tmp_path / "etcd", tls=tls, client_cert_auth=True)
    try:
        await asyncio.to_thread(server.start)
        good = EtcdClient([server.endpoint], timeout_s=TIMEOUT_S, ca_file=str(tls.ca_cert),
                          cert_file=str(tls.server_cert), key_file=str(tls.server_key))
        revision = await good.put("/t/tls", b"ok")
        stored = await good.get("/t/tls")
        assert stored is not None and (stored.value, stored.mod_revision) == (b"ok", revision)
        await good.aclose()
        bare = EtcdClient([server.endpoint], timeout_s=TIMEOUT_S, ca_file=str(tls.ca_cert))
        with pytest.raises(EtcdError, match="connect failed"):
            await bare.connect()
        await bare.aclose()
    finally:
        server.stop()


async def test_user_and_password(etcd_server: EtcdServer) -> None:  # noqa: F811
    """With auth on, the right password works and a wrong one fails without being named."""
    etcdctl = [etcd_binary("etcdctl"), f"--endpoints={etcd_server.endpoint}"]
    for args in (["user", "add", "root:rootpw"], ["user", "add", "node:s3cret-pw"], ["role", "add", "node"],
                 ["role", "grant-permission", "node", "--prefix=true", "readwrite", "/t/"],
                 ["user", "grant-role", "node", "node"], ["auth", "enable"]):
        subprocess.run([*etcdctl, *args], check=True, capture_output=True, timeout=30)
    good = EtcdClient([etcd_server.endpoint], timeout_s=TIMEOUT_S, user="node", password="s3cret-pw")
    try:
        await good.put("/t/auth", b"ok")
        assert (await good.get("/t/auth")).value == b"ok"  # type: ignore[union-attr]
        with pytest.raises(EtcdError, match="permission denied"):
            await good.put("/elsewhere", b"no")
        # etcd forgets its tokens when it restarts: the client logs in again by itself.
        await asyncio.to_thread(etcd_server.restart)
        kv = await eventually(lambda: good.get("/t/auth"), timeout=10, what="the client to log in again")
        assert kv.value == b"ok"
    finally:
        await good.aclose()
    bad = EtcdClient([etcd_server.endpoint], timeout_s=TIMEOUT_S, user="node", password="wrong-pw-123")
    with pytest.raises(EtcdError, match="connect failed") as caught:
        await bad.connect()
    assert "wrong-pw-123" not in str(caught.value) and "\n" not in str(caught.value)
    await bad.aclose()


# -- plain units -----------------------------------------------------------------------------


def test_endpoints_are_parsed_and_credentials_never_echoed() -> None:
    assert str(parse_endpoint("127.0.0.1:2379")) == "http://127.0.0.1:2379"
    assert str(parse_endpoint("https://etcd.example:2380")) == "https://etcd.example:2380"
    assert str(parse_endpoint("etcd")) == "http://etcd:2379"
    assert str(parse_endpoint("http://[::1]:2379")) == "http://[::1]:2379"
    for bad in ("ftp://h:1", "http://h:1/path", "http://user:pw@:1", "h:notaport"):
        with pytest.raises(ValueError, match="etcd endpoint") as caught:
            parse_endpoint(bad)
        assert "pw@" not in str(caught.value)
    with pytest.raises(ValueError, match="both"):
        EtcdClient(["h:1"], user="u")


def test_a_missing_etcd_fails_the_test_and_never_skips(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(etcdlib, "SEARCH", ())
    for name in ("etcd", "etcdctl"):
        with pytest.raises(pytest.fail.Exception, match=f"{name} is not installed: scripts/install-system-deps"):
            etcd_binary(name)


def test_importing_the_adapter_loads_no_grpc() -> None:
    """The daemon may import the adapter module; grpc and aetcd load only on connect."""
    code = ("import sys, supervisor.adapters.etcd as e; e.EtcdClient(['h:1']); e.Lease(1, 2)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'aetcd', 'google')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
