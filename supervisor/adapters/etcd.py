"""etcd v3, as the daemon uses it for multi-node groups and fleet memory: leases that prove
a daemon alive, keys bound to them, compare-and-swap transactions, prefix watches, and a
leader election by etcd's own recipe.

The wire is etcd's native gRPC API (the one etcd 3.4 serves), spoken through ``grpc.aio``
with the generated stubs of ``aetcd`` (the ``[etcd]`` extra). ``aetcd.Client`` itself works
against etcd 3.4, but it only opens plaintext channels to one host, and funnels every watch
through one shared stream; this module needs TLS, a list of endpoints, a deadline on every
call and one stream per watch, so it holds the channel itself. ``grpc`` and ``aetcd`` are
imported on the first ``connect``: a daemon without ``[group]`` or ``[fleet]`` never loads
them.

Every unary call is bounded by ``timeout_s``. Every failure (refused, timed out, refused
credentials, a compacted revision) is an ``EtcdError`` whose ``str()`` is one line naming
the endpoint and the operation. Passwords and the auth token go only into the request:
they are never in a message.

Reconnection is the caller's loop, as with aiomqtt: a call during an outage raises, and
the next call after etcd returns works (gRPC reconnects within ``MAX_BACKOFF_MS``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from supervisor.adapters.ports import EtcdError, KeyValue, Leadership, Lease, WatchEvent

DEFAULT_PORT = 2379
DETAIL_CHARS = 200
MAX_BACKOFF_MS = 2000  # gRPC's default reconnect backoff grows to 120 s; etcd back must be seen within seconds
CHANNEL_OPTIONS = (
    ("grpc.enable_http_proxy", 0),  # an https_proxy in the daemon's environment must not capture etcd
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", MAX_BACKOFF_MS),
    # Find a dead peer under a quiet watch. etcd refuses pings more often than every 5 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    tls: bool

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return ("https://" if self.tls else "http://") + self.target


def parse_endpoint(text: str) -> Endpoint:
    """``http://host:port``, ``https://host:port`` or ``host:port`` (port 2379 if left out)."""
    parts = urlsplit(text if "//" in text else "//" + text)
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        port = 0
    if parts.scheme not in ("", "http", "https") or not parts.hostname or not port or parts.path.strip("/"):
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()  # no user:password@
        raise ValueError(f"etcd endpoint must be http(s)://host:port, got {shown!r}")
    return Endpoint(parts.hostname, port, parts.scheme == "https")


def _client_modules() -> tuple[Any, Any]:
    """``grpc`` and ``aetcd.rpc``, imported on first use."""
    try:
        import grpc  # type: ignore[import-untyped]  # no stubs needed: every value passes through Any
        from aetcd import rpc  # type: ignore[import-untyped]  # generated stubs, no py.typed
    except ImportError as exc:
        raise EtcdError(f"etcd support is not installed ({exc.name} is missing): "
                        "pip install 'sglang-supervisor[etcd]'") from None
    return grpc, rpc


def _prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range for every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\0"


class EtcdClient:
    """One channel to the first endpoint that answers; see the module docstring."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 5.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        if (cert_file is None) != (key_file is None):
            raise ValueError("etcd client certificate needs both cert_file and key_file")
        if (user is None) != (password is None):
            raise ValueError("etcd authentication needs both user and password")
        eps = [parse_endpoint(e) for e in endpoints]
        tls = bool(ca_file or cert_file) or any(e.tls for e in eps)
        self._endpoints = [Endpoint(e.host, e.port, tls) for e in eps]
        self.endpoint = str(self._endpoints[0])  # the one messages name: the one in use
        self.timeout_s = timeout_s
        self._tls_files = (ca_file, cert_file, key_file)
        self._user, self._password = user, password
        self._token: str | None = None
        self._channel: Any = None
        self._stubs: dict[str, Any] = {}
        self._next = 0  # the endpoint to try first
        self._lock = asyncio.Lock()

    # -- the channel ----------------------------------------------------------------------

    async def connect(self) -> None:
        """Opens a channel to the first endpoint that answers within ``timeout_s`` (trying
        them in turn) and authenticates; a no-op when connected."""
        async with self._lock:
            if self._channel is not None:
                return
            grpc, rpc = _client_modules()
            creds = self._credentials(grpc)
            reasons = []
            for i in range(len(self._endpoints)):
                endpoint = self._endpoints[(self._next + i) % len(self._endpoints)]
                self.endpoint = str(endpoint)
                if creds is None:
                    channel = grpc.aio.insecure_channel(endpoint.target, options=CHANNEL_OPTIONS)
                else:
                    channel = grpc.aio.secure_channel(endpoint.target, creds, options=CHANNEL_OPTIONS)
                try:
                    await self._handshake(channel, rpc)
                except grpc.aio.AioRpcError as exc:
                    await channel.close()
                    reasons.append(f"{endpoint}: {self._why(exc)}")
                    continue
                self._channel = channel
                self._stubs = {"kv": rpc.KVStub(channel), "lease": rpc.LeaseStub(channel),
                               "watch": rpc.WatchStub(channel)}
                return
            self._next = 0
            if len(reasons) == 1:
                raise self._error("connect", reasons[0].split(": ", 1)[1])
            raise EtcdError(self._clean("etcd: connect failed on every endpoint: " + "; ".join(reasons)))

    async def _handshake(self, channel: Any, rpc: Any) -> None:
        """A token when a user is set; then a Status call, so a silent endpoint fails here."""
        if self._user is not None:
            resp = await rpc.AuthStub(channel).Authenticate(
                rpc.AuthenticateRequest(name=self._user, password=self._password), timeout=self.timeout_s)
            self._token = resp.token
        await rpc.MaintenanceStub(channel).Status(
            rpc.StatusRequest(), timeout=self.timeout_s, metadata=self._metadata())

    def _credentials(self, grpc: Any) -> Any:
        if not self._endpoints[0].tls:
            return None
        ca, cert, key = (self._read(p) if p else None for p in self._tls_files)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def _read(self, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise EtcdError(f"etcd {self.endpoint}: cannot read TLS file {path}: {exc.strerror}") from None

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("token", self._token),) if self._token else None

    async def aclose(self) -> None:
        channel, self._channel, self._stubs = self._channel, None, {}
        if channel is not None:
            await channel.close()

    async def _drop(self) -> None:
        """After an endpoint stopped answering: with others to try, the next call starts
        from the next one (one endpoint: gRPC itself reconnects)."""
        if len(self._endpoints) > 1:
            self._next = (self._next + 1) % len(self._endpoints)
            await self.aclose()

    # -- one bounded call -----------------------------------------------------------------

    async def _call(self, op: str, stub: str, method: str, request: Any) -> Any:
        grpc, _ = _client_modules()
        for attempt in (1, 2):
            await self.connect()
            try:
                async with asyncio.timeout(self.timeout_s + 1):  # gRPC's deadline, doubly sure
                    return await getattr(self._stubs[stub], method)(
                        request, timeout=self.timeout_s, metadata=self._metadata())
            except grpc.aio.AioRpcError as exc:
                stale = self._stale_token(exc)
                error = await self._failed(op, exc)
                if stale and attempt == 1:
                    continue  # etcd restarted and forgot our token: once more, logged in again
                raise error from None
            except TimeoutError:
                raise self._error(op, f"no answer within {self.timeout_s:g} s") from None
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def _stream_errors(self, op: str) -> AsyncIterator[None]:
        """A stream's failure as one ``EtcdError`` (``_call``'s mapping, without its retry)."""
        grpc, _ = _client_modules()
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(op, exc) from None
        except TimeoutError:
            raise self._error(op, f"no answer within {self.timeout_s:g} s") from None

    async def _failed(self, op: str, exc: Any) -> EtcdError:
        """The error for a failed RPC, after the channel is fixed for the next call: a stale
        auth token (etcd forgets them on restart) closes it, so the next call logs in again;
        a silent endpoint moves on to the next one."""
        grpc, _ = _client_modules()
        if self._stale_token(exc):
            await self.aclose()
        elif exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            await self._drop()
        return self._error(op, self._why(exc))

    def _stale_token(self, exc: Any) -> bool:
        grpc, _ = _client_modules()
        return (self._user is not None and exc.code() == grpc.StatusCode.UNAUTHENTICATED
                and "auth token" in (exc.details() or ""))

    def _why(self, exc: Any) -> str:
        grpc, _ = _client_modules()
        code, details = exc.code(), " ".join((exc.details() or "").split())
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer within {self.timeout_s:g} s"
        if code == grpc.StatusCode.UNAVAILABLE:
            if "last error:" in details:  # gRPC's "failed to connect to all addresses; last error: ...: why"
                details = details.rsplit(": ", 1)[-1]
            return f"unreachable ({details[:DETAIL_CHARS]})" if details else "unreachable"
        return f"{code.name.lower()}: {details[:DETAIL_CHARS]}"

    def _error(self, op: str, detail: str) -> EtcdError:
        return EtcdError(self._clean(f"etcd {self.endpoint}: {op} failed: {detail}"))

    def _clean(self, text: str) -> str:
        """One line, with no password or token in it (should a server ever echo one)."""
        text = " ".join(text.split())
        for secret in (self._password, self._token):
            if secret:
                text = text.replace(secret, "<secret>")
        return text

    # -- leases -----------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> Lease:
        _, rpc = _client_modules()
        resp = await self._call(f"grant a {ttl_s} s lease", "lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=ttl_s))
        if resp.error:
            raise self._error(f"grant a {ttl_s} s lease", resp.error)
        return Lease(resp.ID, resp.TTL)

    async def keep_alive(self, lease: Lease) -> None:
        """Refreshes ``lease`` every third of its TTL until cancelled (run it as a task).

        A failed refresh is retried until a whole TTL has passed since the last one that got
        through; only then, or at once when etcd says the lease is gone, it raises
        ``EtcdError``: the keys on the lease are (or may be) deleted."""
        loop = asyncio.get_running_loop()
        good_until = loop.time() + lease.ttl_s
        op = f"keep lease {lease.id:x} alive"
        while True:
            sent = loop.time()
            try:
                ttl = await self._refresh(op, lease)
            except EtcdError as exc:
                if loop.time() >= good_until:
                    last = str(exc).split(" failed: ", 1)[-1]
                    raise self._error(op, f"lost: not refreshed for {lease.ttl_s} s (last try: {last})") from None
                await asyncio.sleep(min(0.5, max(0.0, good_until - loop.time())))
                continue
            if ttl <= 0:
                raise self._error(op, "etcd says the lease has expired")
            good_until = sent + ttl
            await asyncio.sleep(max(0.2, ttl / 3))

    async def _refresh(self, op: str, lease: Lease) -> int:
        """One keep-alive exchange on a short-lived stream; the TTL etcd granted again."""
        await self.connect()
        grpc, rpc = _client_modules()
        call = self._stubs["lease"].LeaseKeepAlive(
            iter([rpc.LeaseKeepAliveRequest(ID=lease.id)]), timeout=self.timeout_s, metadata=self._metadata())
        try:
            async with self._stream_errors(op), asyncio.timeout(self.timeout_s + 1):
                reply = await call.read()
        finally:
            call.cancel()
        if reply is grpc.aio.EOF:
            raise self._error(op, "the stream closed without an answer")
        return int(reply.TTL)

    async def revoke(self, lease: Lease) -> None:
        """Ends the lease now, deleting its keys; a lease already gone is no error."""
        grpc, rpc = _client_modules()
        try:
            await self._call(f"revoke lease {lease.id:x}", "lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease.id))
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise

    # -- keys -------------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        """Writes ``key`` (bound to ``lease``: deleted when it ends); the revision of the write."""
        _, rpc = _client_modules()
        req = rpc.PutRequest(key=key.encode(), value=value, lease=lease.id if lease else 0)
        return int((await self._call(f"put {key}", "kv", "Put", req)).header.revision)

    async def get(self, key: str) -> KeyValue | None:
        _, rpc = _client_modules()
        resp = await self._call(f"get {key}", "kv", "Range", rpc.RangeRequest(key=key.encode()))
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` in key order, and the revision they were read at (watch
        from one past it to miss nothing)."""
        _, rpc = _client_modules()
        raw = prefix.encode()
        resp = await self._call(f"list {prefix}", "kv", "Range", rpc.RangeRequest(
            key=raw, range_end=_prefix_end(raw), sort_order=rpc.RangeRequest.ASCEND, sort_target=rpc.RangeRequest.KEY))
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

    async def put_if(self, key: str, value: bytes, mod_revision: int, lease: Lease | None = None) -> int | None:
        """Compare-and-swap: writes ``key`` only if its mod_revision is still ``mod_revision``
        (0: only if it is absent). The revision of the write, or None if someone was first."""
        return await self.put_all({key: value}, expect={key: mod_revision}, lease=lease)

    async def put_all(
        self, items: Mapping[str, bytes], expect: Mapping[str, int] | None = None, lease: Lease | None = None,
    ) -> int | None:
        """Writes every key in one transaction, only if each key in ``expect`` still has that
        mod_revision (0: absent). The revision of the write, or None with nothing written."""
        _, rpc = _client_modules()
        compare = [rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, key=k.encode(), mod_revision=rev)
                   for k, rev in (expect or {}).items()]
        success = [rpc.RequestOp(request_put=rpc.PutRequest(key=k.encode(), value=v, lease=lease.id if lease else 0))
                   for k, v in items.items()]
        op = f"put {', '.join(items)}" if len(items) <= 3 else f"put {len(items)} keys"
        resp = await self._call(op, "kv", "Txn", rpc.TxnRequest(compare=compare, success=success))
        return int(resp.header.revision) if resp.succeeded else None

    async def delete(self, key: str) -> bool:
        """Deletes ``key``; whether it was there."""
        _, rpc = _client_modules()
        resp = await self._call(f"delete {key}", "kv", "DeleteRange", rpc.DeleteRangeRequest(key=key.encode()))
        return resp.deleted > 0

    async def delete_prefix(self, prefix: str) -> int:
        """Deletes every key under ``prefix``; how many there were."""
        _, rpc = _client_modules()
        raw = prefix.encode()
        resp = await self._call(f"delete {prefix}*", "kv", "DeleteRange",
                                rpc.DeleteRangeRequest(key=raw, range_end=_prefix_end(raw)))
        return int(resp.deleted)

    # -- watches ----------------------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Every put and delete under ``prefix``, in order, from ``start_revision`` (0: from
        now). The iterator raises ``EtcdError`` when the stream breaks; resume from the last
        event's revision + 1 (a revision etcd has compacted away raises too)."""
        raw = prefix.encode()
        return self._watch(f"watch {prefix}", raw, _prefix_end(raw), start_revision)

    async def _watch(self, op: str, key: bytes, range_end: bytes | None, start_revision: int,
                     no_put: bool = False) -> AsyncGenerator[WatchEvent, None]:
        await self.connect()
        grpc, rpc = _client_modules()
        create = rpc.WatchCreateRequest(key=key, range_end=range_end or b"", start_revision=start_revision,
                                        filters=[rpc.WatchCreateRequest.NOPUT] if no_put else [])
        held = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield rpc.WatchRequest(create_request=create)
            await held.wait()  # closing our side would end the watch

        call = self._stubs["watch"].Watch(requests(), metadata=self._metadata())
        try:
            async with self._stream_errors(op):
                async with asyncio.timeout(self.timeout_s):
                    first = await call.read()
                if first is grpc.aio.EOF or not first.created:
                    raise self._error(op, "etcd did not confirm the watch")
                responses = [first]
                while True:
                    for resp in responses:
                        if resp.compact_revision:
                            raise self._error(op, f"revision {start_revision} is compacted (oldest kept: "
                                                  f"{resp.compact_revision})")
                        if resp.canceled:
                            raise self._error(op, f"etcd cancelled the watch: {resp.cancel_reason or 'no reason given'}")
                        for ev in resp.events:
                            kind: Literal["put", "delete"] = "delete" if ev.type == rpc.Event.DELETE else "put"
                            yield WatchEvent(kind, ev.kv.key.decode(), ev.kv.value, int(ev.kv.mod_revision),
                                         int(ev.kv.create_revision))
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        raise self._error(op, "etcd closed the watch stream")
                    responses = [resp]
        finally:
            held.set()
            call.cancel()

    # -- the election (etcd's concurrency/election.go) ----------------------------------------

    async def campaign(self, prefix: str, lease: Lease, value: bytes = b"") -> Leadership:
        """Stands for leader under ``prefix`` and returns once elected.

        The candidate key is ``<prefix>/<lease id>``, bound to ``lease``; the candidate with
        the lowest create revision leads, and each waits for the deletion of the key just
        before its own (no herd when the leader goes). Cancelled or failed, it withdraws."""
        _, rpc = _client_modules()
        base = prefix.rstrip("/") + "/"
        key = f"{base}{lease.id:x}"
        raw = key.encode()
        resp = await self._call(f"campaign as {key}", "kv", "Txn", rpc.TxnRequest(
            compare=[rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=raw, create_revision=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=value, lease=lease.id))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=raw))],
        ))
        if resp.succeeded:
            revision = int(resp.header.revision)
        else:  # already a candidate with this lease (a campaign retried): keep our place
            revision = int(resp.responses[0].response_range.kvs[0].create_revision)
        try:
            await self._wait_deletes(base, revision - 1)
            mine = await self.get(key)
        except BaseException:
            with contextlib.suppress(EtcdError):
                await self.delete(key)
            raise
        if mine is None or mine.create_revision != revision:  # our lease ended while we waited
            raise self._error(f"campaign as {key}", f"lease {lease.id:x} expired while waiting")
        return Leadership(key, revision, lease)

    async def _wait_deletes(self, base: str, max_create_revision: int) -> None:
        _, rpc = _client_modules()
        raw = base.encode()
        while True:
            resp = await self._call(f"campaign under {base}", "kv", "Range", rpc.RangeRequest(
                key=raw, range_end=_prefix_end(raw), limit=1, max_create_revision=max_create_revision,
                sort_order=rpc.RangeRequest.DESCEND, sort_target=rpc.RangeRequest.CREATE))
            if not resp.kvs:
                return
            ahead = resp.kvs[0].key
            watch = self._watch(f"wait for {ahead.decode()} to go", ahead, None, int(resp.header.revision) + 1,
                                no_put=True)
            try:
                async for ev in watch:
                    if ev.kind == "delete":
                        break
            finally:
                await watch.aclose()

    async def resign(self, leadership: Leadership) -> None:
        """Steps down: deletes our candidate key if it is still the one we were elected with."""
        _, rpc = _client_modules()
        raw = leadership.key.encode()
        await self._call(f"resign {leadership.key}", "kv", "Txn", rpc.TxnRequest(
            compare=[rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=raw,
                                 create_revision=leadership.revision)],
            success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=raw))],
        ))

    async def leader(self, prefix: str) -> KeyValue | None:
        """The current leader's key under ``prefix`` (the oldest candidate), or None."""
        _, rpc = _client_modules()
        raw = (prefix.rstrip("/") + "/").encode()
        resp = await self._call(f"find the leader under {prefix}", "kv", "Range", rpc.RangeRequest(
            key=raw, range_end=_prefix_end(raw), limit=1,
            sort_order=rpc.RangeRequest.ASCEND, sort_target=rpc.RangeRequest.CREATE))
        return _kv(resp.kvs[0]) if resp.kvs else None


def _kv(kv: Any) -> KeyValue:
    return KeyValue(kv.key.decode(), bytes(kv.value), int(kv.create_revision), int(kv.mod_revision), int(kv.lease))
