"""The few etcd v3 calls cluster mode needs, over one asyncio gRPC channel.

The messages and stubs are etcd's own (``etcdserverpb``), as generated and shipped by the
``aetcd`` package; its high-level ``Client`` is not used, because it only opens insecure
channels (node traffic is to be mTLS, so the channel's credentials must be ours to choose)
and its watcher does not resume after etcd restarts. Here every unary call has a deadline,
the lease keep-alive is one long-lived stream, and a watch reports a broken stream as
``WatchLost`` so the caller re-snapshots. No call waits for a dead etcd: the channel
reconnects with a short backoff and calls fail fast meanwhile.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from aetcd import rpc

from kvstore.cluster.cluster_errors import CoordinatorUnavailable, WatchLost
from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

# the most one answer may bring (gRPC's default: 4 MiB). A page of get_prefix (PAGE_KEYS) passes it only
# at values of 32 KiB on average, far above kvstore's; etcd's largest value (a request of 1.5 MiB by
# default) fits many times
MAX_RECEIVE_BYTES = 16 * 1024 * 1024

# etcd refuses client pings more often than every 5 s (GOAWAY "too_many_pings"); a short
# reconnect backoff matters more: a restarted etcd must be found within a lease TTL. gRPC takes
# min_reconnect_backoff_ms as the least time one connection attempt is given to get etcd's SETTINGS
# frame (DESIGN §8, Connecting): at 100 ms an etcd slower to handshake was never reached; 2 s bounds
# how long an attempt lost in a partition delays the next one, below any lease TTL.
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 2_000),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.enable_retries", 0),
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
)

# keys per Range answer of get_prefix: a root holds a generation record for every namespace ever
# invalidated, for good (DESIGN §12.4), and one answer of them all passes any receive limit; a page of
# kvstore's values (small JSON, a few KiB at most) stays far below gRPC's 4 MiB default
PAGE_KEYS = 512


def parse_endpoints(url: str) -> list[str]:
    """``etcd://h1:2379,h2:2379`` (or a bare ``h:p,h:p`` list) -> ``["h1:2379", ...]``."""
    rest = url.removeprefix("etcd://").strip().rstrip("/")
    endpoints = [e.strip() for e in rest.split(",") if e.strip()]
    if not endpoints:
        raise ConfigError(f"--cluster {url!r} names no etcd endpoint (etcd://host:port[,host:port...])")
    for e in endpoints:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--cluster endpoint {e!r} is not host:port")
    if len(endpoints) > 1:
        for e in endpoints:
            try:
                ipaddress.ip_address(e.rpartition(":")[0].strip("[]"))
            except ValueError:
                raise ConfigError(f"--cluster lists several endpoints; give them as IP addresses ({e!r})") from None
    return endpoints


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover exactly the keys starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    kv: KeyValue


def _kv(kv: rpc.KeyValue) -> KeyValue:
    return KeyValue(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)


def _unavailable(what: str, exc: BaseException) -> CoordinatorUnavailable:
    detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
    return CoordinatorUnavailable(f"etcd {what}: {detail}")


class EtcdClient:
    """One channel to an etcd cluster. Coroutine methods are safe to call concurrently from
    one event loop; each raises ``CoordinatorUnavailable`` when etcd does not answer within
    ``call_timeout_s``."""

    def __init__(self, endpoints: Sequence[str], call_timeout_s: float = 2.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        target = endpoints[0] if len(endpoints) == 1 else "ipv4:" + ",".join(endpoints)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=_CHANNEL_OPTIONS)
        self.call_timeout_s = call_timeout_s
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def _call(self, what: str, method: object, request: object) -> object:
        try:
            return await method(request, timeout=self.call_timeout_s)  # type: ignore[operator]
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            raise _unavailable(what, exc) from exc

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease; returns (lease id, TTL etcd granted; it may raise a too-short TTL)."""
        resp = await self._call("lease grant", self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl_s))
        if resp.error:  # type: ignore[attr-defined]
            raise CoordinatorUnavailable(f"etcd lease grant: {resp.error}")  # type: ignore[attr-defined]
        return resp.ID, resp.TTL  # type: ignore[attr-defined]

    async def revoke(self, lease_id: int) -> None:
        """Revokes a lease (its keys go with it). An unknown lease is not an error."""
        try:
            await self._lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise _unavailable("lease revoke", exc) from exc
        except TimeoutError as exc:
            raise _unavailable("lease revoke", exc) from exc

    async def lease_ttl(self, lease_id: int) -> tuple[int, int]:
        """(the TTL a lease was granted, whole seconds it has left by etcd's clock; -1: gone).
        etcd rounds what is left down: up to a second more remains."""
        try:
            resp = await self._lease.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id), timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return 0, -1
            raise _unavailable("lease time-to-live", exc) from exc
        except TimeoutError as exc:
            raise _unavailable("lease time-to-live", exc) from exc
        return resp.grantedTTL, resp.TTL

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Writes a key; returns the revision of the write."""
        resp = await self._call("put", self._kv.Put, rpc.PutRequest(key=key, value=value, lease=lease))
        return resp.header.revision  # type: ignore[attr-defined]

    async def get_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix``, in key order, and the revision the answer is consistent at.

        Read in pages of ``PAGE_KEYS``, each a call with its own deadline, every page after the first at
        the first's revision: one snapshot, whatever is written meanwhile. CoordinatorUnavailable also
        when etcd compacted that revision before the last page (the caller reads again from scratch)."""
        end, key, revision, out = prefix_end(prefix), prefix, 0, []
        while True:
            request = rpc.RangeRequest(key=key, range_end=end, limit=PAGE_KEYS, revision=revision)
            try:
                resp = await self._kv.Range(request, timeout=self.call_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if revision and exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # etcd's ErrCompacted
                    raise CoordinatorUnavailable(f"etcd range: revision {revision} compacted between pages") from exc
                raise _unavailable("range", exc) from exc
            except TimeoutError as exc:
                raise _unavailable("range", exc) from exc
            revision = revision or resp.header.revision
            out.extend(_kv(kv) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return revision, out
            key = resp.kvs[-1].key + b"\0"  # the next key after the last one returned

    async def get(self, key: bytes) -> KeyValue | None:
        resp = await self._call("range", self._kv.Range, rpc.RangeRequest(key=key))
        return _kv(resp.kvs[0]) if resp.kvs else None  # type: ignore[attr-defined]

    async def delete(self, key: bytes) -> None:
        await self._call("delete", self._kv.DeleteRange, rpc.DeleteRangeRequest(key=key))

    async def put_if(self, puts: Sequence[tuple[bytes, bytes, int]], mod_revisions: dict[bytes, int]) -> bool:
        """Atomically writes ``puts`` ((key, value, lease) each) if every key in
        ``mod_revisions`` still has that mod revision (0: the key does not exist)."""
        compare = [rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, key=k, mod_revision=rev)
                   for k, rev in mod_revisions.items()]
        success = [rpc.RequestOp(request_put=rpc.PutRequest(key=k, value=v, lease=lease)) for k, v, lease in puts]
        resp = await self._call("txn", self._kv.Txn, rpc.TxnRequest(compare=compare, success=success))
        return bool(resp.succeeded)  # type: ignore[attr-defined]

    def keepalive(self) -> LeaseKeepAlive:
        return LeaseKeepAlive(self)

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[tuple[int, list[WatchEvent]]]:
        """Yields (revision, events) for every change under ``prefix`` from ``start_revision``
        on, in order. Raises ``WatchLost`` when the stream breaks or the revision was
        compacted away: the caller re-snapshots (``get_prefix``) and watches again."""
        call = self._watch.Watch()
        create = rpc.WatchCreateRequest(key=prefix, range_end=prefix_end(prefix), start_revision=start_revision,
                                        progress_notify=True)
        try:
            await call.write(rpc.WatchRequest(create_request=create))
            async for resp in call:
                if resp.compact_revision:
                    raise WatchLost(f"etcd compacted past revision {start_revision} (now {resp.compact_revision})")
                if resp.canceled:
                    raise WatchLost(f"etcd cancelled the watch: {resp.cancel_reason or 'no reason given'}")
                if resp.events:
                    events = [WatchEvent("put" if ev.type == rpc.Event.PUT else "delete", _kv(ev.kv)) for ev in resp.events]
                    yield resp.header.revision, events
            raise WatchLost("etcd ended the watch stream")
        except grpc.aio.AioRpcError as exc:
            raise WatchLost(f"etcd watch: {exc.code().name}") from exc
        finally:
            call.cancel()


class LeaseKeepAlive:
    """The keep-alive stream of one client: ``ping(lease)`` refreshes the lease and returns
    the TTL etcd now grants it (0: the lease is gone). A broken stream is reopened on the
    next ping."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()

    async def ping(self, lease_id: int, timeout_s: float) -> int:
        async with self._lock:
            try:
                if self._call is None:
                    self._call = self._client._lease.LeaseKeepAlive()
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
                # races with completion, and the keep-alive task would outlive close()
                async with asyncio.timeout(timeout_s):
                    await self._call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                    resp = await self._call.read()
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                self._reset()
                raise _unavailable("lease keep-alive", exc) from exc
            if resp is grpc.aio.EOF:
                self._reset()
                raise CoordinatorUnavailable("etcd closed the lease keep-alive stream")
            return int(resp.TTL)

    def _reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None

    def close(self) -> None:
        self._reset()
