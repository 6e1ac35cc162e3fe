"""A ``KVStoreClient`` for an engine that calls synchronously.

vLLM and SGLang call their cache hooks on their own threads and must never stall on the
store. Every call goes through the client's own I/O runtime (``client.runtime``: one event
loop thread and one channel per client) and is bounded by the caller's timeout without
waiting for a cancelled call to unwind: ``Runtime.submit`` hands back a job the hook waits
on as long as it chooses; a lease that a late answer brings is given back.

More: client/adapters/README.md (### connection.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore._proto import data_pb2, directory_pb2
from kvstore.client.client import KVStoreClient
from kvstore.client.transport import ShmTransport
from kvstore.errors import ConfigError, KVStoreError, PermissionDenied, Unauthenticated
from kvstore.security.credentials import Credentials
from kvstore.types import PAGE_KEY_BYTES, Namespace

logger = logging.getLogger(__name__)

T = TypeVar("T")

RELEASE_TIMEOUT_S = 0.2  # a release over the call channel blocks a hook this long at most (to connect; the lease then expires)


@dataclass(frozen=True)
class ArenaLease:
    """Leading pages of a lookup, pinned in the server's shared arena until ``expires_at``
    (``time.monotonic()``) or release: where each page's bytes are and their checksum.
    ``namespace_id``: the (salted) namespace the pages were leased in; ``generation``: its
    generation read before them (the request's saves name it, DESIGN §3)."""

    lease_id: bytes
    offsets: list[int]
    checksums: list[int]
    expires_at: float
    namespace_id: bytes = b""
    arena_token: bytes = b""  # the arena the offsets are in: a worker whose client maps another does not copy
    generation: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.offsets)


class StoreConnection:
    """One namespace's client, connected lazily and reconnected after failures.

    ``namespace`` is the one configured: on a server with tenants its id is not the one the
    server knows, which is the connected client's (``client().namespace``, with the tenant's
    salt). ``credentials``: the token and TLS to present. Counters: ``num_unreachable``
    (connections that failed), ``num_refused`` (refused by the server).

    Thread-safe: every method may be called from any thread."""

    def __init__(self, address: str, namespace: Namespace, *, use_shm: bool = True, connect_timeout_s: float = 2.0,
                 retry_s: float = 1.0, use_call_socket: bool = True, credentials: Credentials | None = None) -> None:
        self.address = address
        self.namespace = namespace
        self.credentials = credentials or Credentials()
        self.num_unreachable = 0
        self.num_refused = 0
        self.refused: ConfigError | None = None  # the last refusal, until a connection succeeds
        self.use_shm = use_shm
        self.use_call_socket = use_call_socket  # the server's same-host call channel for leases, when offered
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._client: KVStoreClient | None = None
        self._seen_before: int | None = None  # the highest generation the clients dropped before this one saw
        self._next_try = 0.0
        self._closed = False
        self._connecting = False
        self._threads: list[threading.Thread] = []  # connecting or closing a client: close() waits for them

    def start(self) -> bool:
        """Connects now (engine start-up may wait ``connect_timeout_s``); False when the
        store cannot be reached yet (a connection is then tried in the background). Raises
        ConfigError, naming the option to fix, when the server refuses the credentials."""
        thread = self._connect_later()
        if thread is not None:
            thread.join(self.connect_timeout_s)
        if self.refused is not None:
            raise self.refused
        return self._client is not None

    def client(self) -> KVStoreClient | None:
        """The connected client, or None while the store cannot be reached (a connection
        attempt is then started in the background; this never blocks)."""
        if self._client is None:
            self._connect_later()
        return self._client

    def _connect_later(self) -> threading.Thread | None:
        with self._lock:
            if self._client is not None or self._closed or self._connecting or time.monotonic() < self._next_try:
                return None
            self._connecting = True
            self._next_try = time.monotonic() + self.retry_s
        return self._spawn(self._connect(), "kvstore-connect")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> threading.Thread:
        """Runs ``coro`` to its end on a thread of its own (its own short-lived event loop)."""
        thread = threading.Thread(target=asyncio.run, args=(coro,), name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
        return thread

    async def _connect(self) -> None:
        client = KVStoreClient(self.address, self.namespace, use_shm=self.use_shm, use_call_socket=self.use_call_socket,
                               token=self.credentials.token, tls=self.credentials.tls)
        try:  # asyncio.timeout, not 3.11's wait_for, which swallows a cancel arriving as the connect ends (nothing cancels it today)
            async with asyncio.timeout(self.connect_timeout_s):
                await client.connect()
                await _learn_generation(client)
        except Exception as exc:  # noqa: BLE001 - whatever stops the connection, requests recompute
            await _close_client(client)
            if _refusal(exc):
                self._refuse(exc)
                return
            self.num_unreachable += 1
            logger.warning("kvstore at %s not reachable (%s); requests recompute, retrying in %.1f s",
                           self.address, exc, self.retry_s)
            with self._lock:
                self._connecting = False
            return
        logger.info("kvstore connector connected to %s (%s, unary calls over %s), namespace %s", self.address,
                    "shared memory" if client.shared_memory else "gRPC", "the call socket" if client.calls.blocking else "gRPC",
                    client.namespace.namespace_id.hex())
        with self._lock:
            self._connecting = False
            self.refused = None
            closed = self._closed
            if not closed:
                self._client = client
        if closed:
            await _close_client(client)

    def _refuse(self, exc: Exception) -> None:
        """The server refused this client (its token, or its namespace): a configuration error
        that ``start`` raises; logged as an error when it is news, counted always."""
        if isinstance(exc, ConfigError):  # a token that may not go there in clear text, a tenant_salt set by hand
            refused = ConfigError(f"kvstore at {self.address}: {exc}")
        else:
            fix = (f"check the token of {self.credentials.named_by}" if self.credentials.token is not None
                   else f"give a token with {self.credentials.named_by}")
            refused = ConfigError(f"kvstore at {self.address} refuses this client ({exc}): {fix}")
        with self._lock:
            self._connecting = False
            news = self.refused is None or str(self.refused) != str(refused)
            self.refused = refused
        self.num_refused += 1
        if news:
            logger.error("%s (tried again every %.1f s; meanwhile requests recompute)", refused, self.retry_s)

    def generation_seen(self) -> int | None:
        """The highest namespace generation an answer to any client of this connection named
        (None: none yet), kept across reconnects: a request that came while the store could not
        be reached computes in it, a lower bound of the current one (DESIGN §3)."""
        client = self._client
        return _highest(self._seen_before, client.generation_seen if client is not None else None)

    def probe_generation(self, client: KVStoreClient, timeout_s: float) -> int | None:
        """The namespace's generation now (one lookup of a key nobody stores), for a request that
        learns none of its own; ``generation_seen()`` when it does not answer."""
        try:
            return self.stored_prefix(client, [bytes(PAGE_KEY_BYTES)], timeout_s)[1]
        except (KVStoreError, TimeoutError) as exc:
            self.failed(client, exc)
            return self.generation_seen()

    def failed(self, client: KVStoreClient, reason: object) -> threading.Thread | None:
        """Drops ``client`` after a transport failure; the next ``client()`` reconnects. An
        error the server answered with (a subclass of KVStoreError: full tier, missing
        page, ...) says the connection works, and keeps it; but Unauthenticated (the token
        was revoked) drops it too, so that the reconnection reports the refusal. Returns the
        thread closing the dropped client (its loads and saves are abandoned once it ends),
        None if kept."""
        if isinstance(reason, KVStoreError) and type(reason) is not KVStoreError and not isinstance(reason, Unauthenticated):
            return None
        with self._lock:
            if self._client is not client:
                return None
            self._client = None
            self._seen_before = _highest(self._seen_before, client.generation_seen)
            self._next_try = time.monotonic() + self.retry_s
        logger.warning("kvstore connection to %s dropped: %s", self.address, reason)
        return self._spawn(_close_client(client), "kvstore-close")

    def acquire(self, client: KVStoreClient, keys: list[bytes], timeout_s: float) -> ArenaLease | None:
        """Looks up and leases the stored prefix of ``keys`` in one RPC (same-host clients:
        the lease says where the bytes are). None when no answer came within ``timeout_s``
        (the call goes on, and a lease it brings later is given back) or the store failed."""
        started = time.monotonic()
        if client.calls.blocking is not None:
            return self._acquire_here(client, keys, timeout_s, started)
        try:
            transport = client.transport
            assert isinstance(transport, ShmTransport), "leases are taken only on the server's host"
            job = client.runtime.submit(transport.acquire(keys))
            acq = job.result.result(timeout_s)
        except FutureTimeout:
            job.result.add_done_callback(lambda late: self._release_late(client, late))
            return None
        except KVStoreError as exc:
            self.failed(client, exc)
            return None
        return self._lease(client, acq, started)

    def num_stored(self, client: KVStoreClient, keys: list[bytes], timeout_s: float) -> int:
        """How many leading ``keys`` are stored (``stored_prefix``'s pages)."""
        return self.stored_prefix(client, keys, timeout_s)[0]

    def stored_prefix(self, client: KVStoreClient, keys: list[bytes], timeout_s: float) -> tuple[int, int]:
        """How many leading ``keys`` are stored, and the namespace generation read before them:
        over the same-host call channel from this thread when the client has one (no hop to the
        runtime, as ``acquire``), else a bounded ``run`` of ``lookup_keys``. TimeoutError past
        ``timeout_s``; KVStoreError."""
        calls = client.calls
        if calls.blocking is None:
            hit = self.run(client, client.lookup_keys(keys), timeout_s)
            return hit.num_pages, hit.generation
        deadline, found, generation = time.monotonic() + timeout_s, 0, None
        for start in range(0, len(keys), client.max_pages):
            batch = keys[start : start + client.max_pages]
            request = directory_pb2.LookupRequest(namespace_id=client.namespace.namespace_id, keys=batch)
            answer = calls.call("Directory.Lookup", request, max(1e-3, deadline - time.monotonic()))
            if generation is not None and answer.generation != generation:  # invalidated between two batches
                return 0, int(answer.generation)
            generation = int(answer.generation)
            found += answer.num_pages
            if found < start + len(batch):
                break
        if generation is None:
            return 0, client.generation_seen or 0
        client.saw_generation(generation)
        return found, generation

    def _acquire_here(self, client: KVStoreClient, keys: list[bytes], timeout_s: float, started: float) -> ArenaLease | None:
        """``acquire`` over the same-host call channel, blocking this thread (no event-loop hop);
        past ``timeout_s`` the channel gives back a lease that comes late."""
        request = data_pb2.AcquireRequest(namespace_id=client.namespace.namespace_id, keys=keys, ttl_ms=client.lease_ms)
        try:
            acq = client.calls.call("Data.Acquire", request, timeout_s)
        except TimeoutError:
            return None
        except KVStoreError as exc:
            self.failed(client, exc)
            return None
        return self._lease(client, acq, started)

    def _lease(self, client: KVStoreClient, acq: Any, started: float) -> ArenaLease:
        """The ArenaLease of an Acquire's answer, over either channel; an empty one is given back at once."""
        namespace_id, generation = client.namespace.namespace_id, int(acq.generation)
        client.saw_generation(generation)
        if not acq.pages:
            self.release(client, acq.lease_id)
            return ArenaLease(acq.lease_id, [], [], started, namespace_id, generation=generation)
        return ArenaLease(acq.lease_id, [p.offset for p in acq.pages], [p.checksum for p in acq.pages],
                          started + client.lease_ms / 1000, namespace_id, bytes(acq.arena_token), generation)

    def _release_late(self, client: KVStoreClient, late: Future[Any]) -> None:
        if not late.cancelled() and late.exception() is None:
            self.release(client, late.result().lease_id)

    def release(self, client: KVStoreClient, lease_id: bytes, failed: list[bytes] | None = None) -> None:
        """Gives a lease back in the background (a release that fails, or a client closed
        meanwhile, leaves it to expire with its TTL); ``failed``: its pages whose copy failed
        the checksum (the server checks and quarantines them, server/placement/reported.py)."""
        try:
            if client.calls.blocking is not None:  # a send of a few microseconds: cheaper than handing it to the runtime
                request = data_pb2.ReleaseRequest(lease_id=lease_id, failed=failed or [])
                client.calls.post("Data.Release", request, RELEASE_TIMEOUT_S)
                return
            transport = client.transport
            if isinstance(transport, ShmTransport):
                client.runtime.submit(transport.release(lease_id, failed))
        except (KVStoreError, TimeoutError) as exc:
            logger.debug("lease %s not released (it expires): %s", lease_id.hex()[:8], exc)

    def run(self, client: KVStoreClient, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Runs one of ``client``'s coroutines on its runtime and waits at most ``timeout_s``:
        past that it is cancelled (its cleanup runs on in the background) and TimeoutError
        raised. A client closed meanwhile raises KVStoreError."""
        job = client.runtime.submit(coro)
        try:
            return job.result.result(timeout_s)
        except FutureTimeout:
            job.cancel()
            raise TimeoutError(f"no answer from kvstore at {self.address} within {timeout_s} s") from None

    def close(self, timeout_s: float = 5.0) -> None:
        """Closes the client and waits (at most ``timeout_s``) for every connect and close
        still running; the connection cannot be used again."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            self._spawn(_close_client(client), "kvstore-close")
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("kvstore connection to %s: %s still running %.0f s after close", self.address,
                               thread.name, timeout_s)


def _highest(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


async def _learn_generation(client: KVStoreClient) -> None:
    """The namespace's generation, learned at connect: a request that learns none of its own (no
    lookup, a decode's handoff) saves in the highest its client saw (vllm/scheduler.py). A token
    without the read right learns none: its saves then name none (the server's current)."""
    try:
        await client.lookup_keys([bytes(PAGE_KEY_BYTES)])
    except KVStoreError as exc:
        logger.info("kvstore: the namespace's generation was not learned at connect (%s)", exc)


def _refusal(exc: BaseException) -> bool:
    """True for a connection the server refused (credentials, namespace), not one that failed."""
    if isinstance(exc, Unauthenticated):
        return "token withheld" not in str(exc)  # not sent: another uid holds the port (security/loopback_owner.py)
    return isinstance(exc, (PermissionDenied, ConfigError))


async def _close_client(client: KVStoreClient) -> None:
    try:
        await client.close()
    except KVStoreError as exc:
        logger.warning("kvstore client did not close cleanly: %s", exc)
    except RuntimeError as exc:  # an engine shut down from atexit: no thread may start any more
        if "interpreter shutdown" not in str(exc):
            raise
        logger.info("kvstore client left open at interpreter exit (its leases and allocations expire)")
