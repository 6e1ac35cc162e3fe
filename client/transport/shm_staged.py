"""The shared-memory path's holders for layer-wise loads and saves (``Staged``, ``Outgoing``).

A load's pages are read in place from their leased arena slots. A load that copies on a
device (its KV is on one: ``on_device``) asks Acquire for device placement, and the pages the
server placed in this client's hbm pool are read from there instead, device to device; the
others, and every page when no pool is mapped, from the arena (page-locked, client/arena.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from kvstore.client.device_pool import PoolMap
from kvstore.errors import KVStoreError
from kvstore.page import checksum

if TYPE_CHECKING:
    from kvstore.client.arena import ArenaMap
    from kvstore.client.transport.shm import ShmTransport

logger = logging.getLogger(__name__)


class LeasedPages:
    """A layer-wise load's pages, read in place from their leased arena slots."""

    def __init__(self, shm: ShmTransport, on_device: bool = False) -> None:
        self.shm = shm
        self.pages: list[torch.Tensor] = []
        self.checksums: list[int] = []
        # the pool device placement is asked for in (None: the pages are read from the arena)
        self.pool: PoolMap | None = shm.pools.mapping() if on_device and shm.pools is not None else None
        self.on_device: list[bool] = []  # page i is read from the pool: checked once it landed (load.py)
        self.leases: list[bytes] = []  # every lease granted, empty ones included, until released
        self._offsets: list[int] = []
        self._arena = shm.arena  # the arena the leases' offsets are in (held from fill to release)
        self._held: ArenaMap | None = None
        self._keys: list[bytes] = []
        self._failed: list[bytes] = []  # reported at release

    async def fill(self, keys: list[bytes], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        sources: list[Any] = []
        while len(sources) < len(keys):
            if loop.time() >= deadline:
                raise KVStoreError("deadline passed while the pages were leased")
            batch = keys[len(sources) : len(sources) + self.shm.peer.max_pages]
            acq = await self.shm.granted(self.shm.acquire(batch, device=self.pool is not None),
                                         lambda acq: self.shm.release(acq.lease_id))
            self.leases.append(acq.lease_id)
            if not acq.pages:
                break
            arena = await self.shm.mapping(acq, _nothing)  # a lease taken is released by release()
            if self._held is not None:
                arena.drop()  # held once, by the first batch
                if arena is not self._held:
                    raise KVStoreError("the server restarted while the pages were leased; try again")
            self._arena = self._held = arena
            pool = self.pool if self.pool is not None and bytes(acq.pool_token) == self.pool.token else None
            if self.pool is not None and self.shm.pools is not None:
                self.shm.pools.answered(bytes(acq.pool_token))  # another pool than ours: a restarted server's
            sources.extend((page, pool if page.on_device else None) for page in acq.pages)
        n = self.shm.layout.page_bytes
        self._offsets = [page.offset for page, _ in sources]
        self._keys = [page.key for page, _ in sources]
        self.pages = [self._arena.slot(page.offset, n) if pool is None else pool.slot(page.device_offset, n)
                      for page, pool in sources]
        self.on_device = [pool is not None for _, pool in sources]
        self.checksums = [page.checksum for page, _ in sources]

    def verify(self) -> int:
        """The leading pages whose arena bytes hold their checksum; a page read from the pool
        is not read back to the host here (the server checked it on its way in; what lands in
        the engine's KV is checked after each layer, load.py)."""
        n = self.shm.layout.page_bytes
        for i, offset in enumerate(self._offsets):
            if self.on_device[i]:
                continue
            if checksum(self._arena.array[offset : offset + n]) != self.checksums[i]:
                logger.error("page %d of a hit failed its checksum; loading the %d pages before it", i, i)
                self.failed_at(i)
                return i
        return len(self._offsets)

    def failed_at(self, page: int) -> None:
        """Page ``page`` failed its checksum where it was copied: named at release (the server
        checks it and quarantines it if its bytes do fail, kvstore/server/placement/reported.py)."""
        if page < len(self._keys):
            self._failed = [self._keys[page]]

    async def renew(self, timeout_s: float) -> None:
        for lease_id in list(self.leases):
            await self.shm.renew(lease_id, timeout_s)

    async def release(self) -> None:
        leases, self.leases = self.leases, []
        held, self._held = self._held, None
        if held is not None:  # the load's copies ended (load.py drains them first)
            held.drop()
        for lease_id in leases:  # a failed key is checked only by the lease that holds it
            await self.shm.release(lease_id, self._failed)


class SlotOutgoing:
    """A layer-wise save's pages, copied straight into allocated arena slots and committed
    at publish; an allocation not committed is aborted at discard."""

    def __init__(self, shm: ShmTransport, session_id: str = "", generation: int | None = None) -> None:
        self.shm = shm
        self.session_id = session_id  # named at allocation: the commit is refused once the session is fenced
        self.generation = generation  # named at allocation: refused, also at commit, once an invalidation raised it
        self.buffers: list[torch.Tensor] = []
        self.indices: list[int] = []
        self.asked = 0
        self._alloc: Any = None
        self._keys: list[bytes] = []
        self._held: ArenaMap | None = None  # the arena of the reserved slots, from reserve to discard

    async def reserve(self, keys: list[bytes], parent: bytes = b"") -> None:
        alloc = await self.shm.granted(self.shm.allocate(keys, parent, self.generation, self.session_id),
                                       lambda alloc: self.shm.abort(alloc.allocation_id))
        self._alloc = alloc  # given back by discard, also when the mapping below fails or is cancelled
        arena = self._held = await self.shm.mapping(alloc, _nothing)
        todo = [(i, slot) for i, slot in enumerate(alloc.slots) if not slot.exists]
        self.indices = [i for i, _ in todo]
        self._keys = [slot.key for _, slot in todo]
        self.buffers = [arena.slot(slot.offset, self.shm.layout.page_bytes) for _, slot in todo]
        self.asked = len(alloc.slots)

    async def publish(self, checksums: list[int], durable: bool) -> int:
        assert self._alloc is not None, "publish follows reserve"
        published = await self.shm.commit(self._alloc.allocation_id, self._keys, checksums, durable)
        self._alloc = None  # a commit that failed is aborted by discard
        return published

    @property
    def term_s(self) -> float:
        """How long the server keeps the reserved slots unrenewed (inf before reserve)."""
        return self._alloc.ttl_ms / 1000 if self._alloc is not None and self._alloc.ttl_ms else math.inf

    async def renew(self, timeout_s: float) -> None:
        """Keeps the reserved slots for another term; LeaseExpired when they were freed
        (the save must then never write into them: another writer may hold them)."""
        if self._alloc is not None:
            await self.shm.renew(self._alloc.allocation_id, timeout_s, ttl_ms=0)

    async def written(self, layers: int, timeout_s: float) -> None:
        """A renewal that also names the leading layers stored in every slot (DESIGN §12.7)."""
        if self._alloc is not None:
            await self.shm.renew(self._alloc.allocation_id, timeout_s, ttl_ms=0, layers_written=layers)

    async def discard(self) -> None:
        """Ends the save (after its last copy into the slots): the arena let go, an allocation
        not committed aborted."""
        alloc, self._alloc = self._alloc, None
        held, self._held = self._held, None
        if held is not None:
            held.drop()
        if alloc is not None:
            await self.shm.abort(alloc.allocation_id)


async def _nothing() -> None:
    """Nothing to give back here (the caller does)."""
