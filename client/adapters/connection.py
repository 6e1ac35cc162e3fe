"""A ``KVStoreClient`` for an engine that calls synchronously.

vLLM and SGLang call their cache hooks on their own threads and must never stall on the store, so the
asyncio client lives on a private event loop thread and every blocking call is bounded
by a timeout. A store that cannot be reached is a miss, not an engine error: after a
failure the connection is dropped and tried again at most every ``retry_s`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.client.client import KVStoreClient
from kvstore.client.transport import ShmTransport
from kvstore.errors import KVStoreError
from kvstore.types import Namespace

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Lease:
    """Leading pages of a lookup, pinned in the server's shared arena until ``expires_at``
    (``time.monotonic()``) or release: where each page's bytes are and their checksum."""

    lease_id: bytes
    offsets: list[int]
    checksums: list[int]
    expires_at: float

    @property
    def num_pages(self) -> int:
        return len(self.offsets)


class StoreConnection:
    """One namespace's client, connected lazily and reconnected after failures.

    Thread-safe: ``client()``, ``run()`` and ``submit()`` may be called from any thread."""

    def __init__(self, address: str, namespace: Namespace, *, use_shm: bool = True, connect_timeout_s: float = 2.0,
                 retry_s: float = 1.0) -> None:
        self.address = address
        self.namespace = namespace
        self.use_shm = use_shm
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-connector-loop", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._client: KVStoreClient | None = None
        self._next_try = 0.0
        self._closed = False
        self._connecting = False
        # Blocking RPCs on the client's synchronous channel: one hop to a thread, no event
        # loop, and the caller waits only as long as it chooses. Releases have their own
        # thread so that a lookup never queues behind one.
        self._rpc = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-connector-rpc")
        self._releases = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-connector-release")

    def start(self) -> bool:
        """Connects now (engine start-up may wait ``connect_timeout_s``); False when the
        store cannot be reached yet (a connection is then tried in the background)."""
        future = self._connect_later()
        if future is None:
            return self._client is not None
        try:
            future.result(self.connect_timeout_s)
        except FutureTimeout:
            return False
        return self._client is not None

    def client(self) -> KVStoreClient | None:
        """The connected client, or None while the store cannot be reached (a connection
        attempt is then started in the background; this never blocks)."""
        if self._client is None:
            self._connect_later()
        return self._client

    def _connect_later(self) -> Future[None] | None:
        with self._lock:
            if self._client is not None or self._closed or self._connecting or time.monotonic() < self._next_try:
                return None
            self._connecting = True
            self._next_try = time.monotonic() + self.retry_s
        return self.submit(self._connect())

    async def _connect(self) -> None:
        client = KVStoreClient(self.address, self.namespace, use_shm=self.use_shm)
        try:
            await asyncio.wait_for(client.connect(), self.connect_timeout_s)
        except Exception as exc:  # noqa: BLE001 - whatever stops the connection, requests recompute
            logger.warning("kvstore at %s not reachable (%s); requests recompute, retrying in %.1f s",
                           self.address, exc, self.retry_s)
            await client.close()
            with self._lock:
                self._connecting = False
            return
        logger.info("kvstore connector connected to %s (%s)", self.address,
                    "shared memory" if client.shared_memory else "gRPC")
        with self._lock:
            self._connecting = False
            if self._closed:
                self.submit(client.close())
                return
            self._client = client

    def failed(self, client: KVStoreClient, reason: object) -> None:
        """Drops ``client`` after a transport failure; the next ``client()`` reconnects. An
        error the server answered with (a subclass of KVStoreError: full tier, missing
        page, ...) says the connection works, and keeps it."""
        if isinstance(reason, KVStoreError) and type(reason) is not KVStoreError:
            return
        with self._lock:
            if not self._holds(client):
                return
            self._client = None
            self._next_try = time.monotonic() + self.retry_s
        logger.warning("kvstore connection to %s dropped: %s", self.address, reason)
        self.submit(client.close())

    def _holds(self, client: KVStoreClient) -> bool:
        return self._client is client

    def acquire(self, client: KVStoreClient, keys: list[bytes], timeout_s: float) -> Lease | None:
        """Looks up and leases the stored prefix of ``keys`` in one RPC (same-host clients:
        the lease says where the bytes are). None when no answer came within ``timeout_s``
        (a lease granted later is released) or the store failed."""
        started = time.monotonic()
        future = self._rpc.submit(self._acquire, client, keys)
        try:
            acq = future.result(timeout_s)
        except FutureTimeout:
            future.add_done_callback(lambda f: self._release_late(client, f))
            return None
        except KVStoreError as exc:
            self.failed(client, exc)
            return None
        if not acq.pages:
            self.release(client, acq.lease_id)
            return Lease(acq.lease_id, [], [], started)
        return Lease(acq.lease_id, [p.offset for p in acq.pages], [p.checksum for p in acq.pages],
                     started + client.lease_ms / 1000)

    @staticmethod
    def _acquire(client: KVStoreClient, keys: list[bytes]) -> Any:
        """One Acquire on the client's own I/O runtime (same-host clients: the shm transport)."""
        transport = client.transport
        assert isinstance(transport, ShmTransport), "leases are taken only on the server's host"
        return client.runtime.run(transport.acquire(keys), client.timeout_s)

    @staticmethod
    def _release(client: KVStoreClient, lease_id: bytes) -> None:
        transport = client.transport
        if isinstance(transport, ShmTransport):
            try:
                client.runtime.run(transport.release(lease_id), client.timeout_s)
            except KVStoreError as exc:
                logger.warning("release of a lease failed (it expires with its ttl): %s", exc)

    def _release_late(self, client: KVStoreClient, future: Future[Any]) -> None:
        if future.exception() is None:
            self.release(client, future.result().lease_id)

    def release(self, client: KVStoreClient, lease_id: bytes) -> None:
        """Gives a lease back in the background (a failed release expires with its TTL)."""
        if not self._closed:
            self._releases.submit(self._release, client, lease_id)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Runs ``coro`` on the loop; raises TimeoutError (and cancels it) past ``timeout_s``."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"no answer from kvstore at {self.address} within {timeout_s} s") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Runs ``coro`` on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                self.run(client.close(), timeout_s)
            except (KVStoreError, TimeoutError) as exc:
                logger.warning("kvstore client did not close cleanly: %s", exc)
        self._rpc.shutdown(wait=False, cancel_futures=True)
        self._releases.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
