"""The hbm tier as one device pool per tenant: a pool follows the host arenas' trust model.

Whoever maps a pool reads and writes every slot in it (a CUDA IPC mapping cannot be made
read-only), so a pool is a trust domain, as an arena is (arenas.py): with tenants each gets
its own, holding only the pages of the namespaces it owns, and the arena socket hands it
only to that tenant's tokens. Without tenants, or with ``--share-arena`` (tenants that trust
each other), there is one pool, as there is one arena.

The placement core still sees one upper tier: a slot number says which pool it is in (pool
``i`` numbers its slots from ``i << POOL_BITS``), a key is in at most one pool (its
namespace's owner's), and what must happen in one owner's pool (reserving a slot, choosing
a victim) is asked of that pool, ``part(owner)``. A pool is made at its owner's first use,
of ``--hbm-capacity`` bytes each, and lives as long as the server: engines hold mappings of
it. Without tenants the one pool is made at start, so that a device that cannot hold it
refuses the server at once.

Thread-safety: every pool guards itself; the list of pools only grows (under ``_lock``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Container, Sequence

from kvstore.config import HbmTierConfig
from kvstore.device_ops import DeviceOps, ops_for_pool
from kvstore.errors import TierFull
from kvstore.page import PageHeader
from kvstore.tiers.base import Quarantined, ReadResult, StoredPage, TierUsage
from kvstore.tiers.hbm import HbmTier, check_device
from kvstore.tiers.slab import round_up

logger = logging.getLogger(__name__)

POOL_BITS = 40  # a pool holds at most 1 TiB; slot >> POOL_BITS is its pool
UNOWNED = ""  # the owner of the one pool without tenants (and of pages no tenant owns)


class TenantPools:
    """The upper tier over one hbm pool per owner (see the module docstring)."""

    name = "hbm"

    def __init__(self, config: HbmTierConfig, per_tenant: bool, ops: DeviceOps | None = None) -> None:
        self.config = config
        self.ops = ops or ops_for_pool(check_device(config))
        self.per_tenant = per_tenant
        self._pools: list[HbmTier] = []
        self._by_owner: dict[str, HbmTier] = {}
        self._lock = threading.Lock()
        if not per_tenant:
            self.part(UNOWNED)

    # -- the pools -----------------------------------------------------------------------

    def part(self, owner: str) -> HbmTier:
        """``owner``'s pool, made now at its first use (TierFull when the device cannot hold it)."""
        owner = owner if self.per_tenant else UNOWNED
        found = self._by_owner.get(owner)
        if found is not None:
            return found
        with self._lock:
            found = self._by_owner.get(owner)
            if found is None:
                try:
                    found = HbmTier(self.config, self.ops, base=len(self._pools) << POOL_BITS)
                except (RuntimeError, OSError) as exc:  # out of device memory, or no memory for the emulation
                    raise TierFull(f"no hbm pool for tenant {owner!r}: {exc}") from None
                self._pools.append(found)
                self._by_owner[owner] = found
                logger.info("hbm pool %d made for tenant %r", len(self._pools) - 1, owner)
            return found

    def parts(self) -> list[HbmTier]:
        return list(self._pools)

    def token_of(self, slot: int) -> bytes:
        """The token of the pool ``slot`` is in (an Acquire answer names it with the offsets)."""
        return self._at(slot).handout.token

    def _at(self, slot: int) -> HbmTier:
        return self._pools[slot >> POOL_BITS]

    def _holder(self, key: bytes) -> HbmTier | None:
        return next((pool for pool in list(self._pools) if pool.contains(key)), None)

    # -- slots: in the pool their number names -------------------------------------------

    def reserve(self, payload_bytes: int) -> int | None:
        return self.part(UNOWNED).reserve(payload_bytes)

    def unreserve(self, slot: int) -> None:
        self._at(slot).unreserve(slot)

    def write(self, slot: int, header: PageHeader, payload: memoryview) -> None:
        self._at(slot).write(slot, header, payload)

    def write_many(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        for slot, header, payload in pages:
            self.write(slot, header, payload)

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        for pool in self.parts():
            mine = [page for page in pages if self._at(page[0]) is pool]
            if mine:
                pool.commit(mine)

    def offset(self, slot: int) -> int:
        return self._at(slot).offset(slot)

    def fits(self, page_bytes: int) -> bool:
        return 0 < round_up(page_bytes) <= self.config.slab_bytes  # every pool's slabs are of this size

    # -- keys: in the pool that holds them -----------------------------------------------

    def read_into(self, pages: list[tuple[bytes, memoryview]]) -> ReadResult:
        for index, page in enumerate(pages):
            pool = self._holder(page[0])
            if pool is None:
                return ReadResult(index)
            result = pool.read_into([page])
            if result.num_read == 0:
                return ReadResult(index, result.reason)
        return ReadResult(len(pages))

    def contains(self, key: bytes) -> bool:
        return self._holder(key) is not None

    def header(self, key: bytes) -> PageHeader | None:
        pool = self._holder(key)
        return pool.header(key) if pool is not None else None

    def slot_of(self, key: bytes) -> int | None:
        pool = self._holder(key)
        return pool.slot_of(key) if pool is not None else None

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        return sum(pool.delete(keys, evicted) for pool in self.parts())

    def quarantine(self, key: bytes, reason: str) -> None:
        pool = self._holder(key)
        if pool is not None:
            pool.quarantine(key, reason)

    def quarantined(self) -> list[Quarantined]:
        return [q for pool in self.parts() for q in pool.quarantined()]

    def purge_quarantine(self) -> int:
        return sum(pool.purge_quarantine() for pool in self.parts())

    def touch(self, key: bytes) -> None:
        pool = self._holder(key)
        if pool is not None:
            pool.touch(key)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        """The next victim of any pool (room is made in one owner's pool with ``part(owner).victim``)."""
        return next((v for pool in self.parts() if (v := pool.victim(pinned, page_bytes)) is not None), None)

    def stored_keys(self) -> list[bytes]:
        return [key for pool in self.parts() for key in pool.stored_keys()]

    # -- index ---------------------------------------------------------------------------

    def recover(self) -> list[StoredPage]:
        return []  # device memory: what the last process held is gone

    def usage(self) -> TierUsage:
        usages = [pool.usage() for pool in self.parts()]
        return TierUsage(sum(u.num_pages for u in usages), sum(u.used_bytes for u in usages),
                         sum(u.capacity_bytes for u in usages))

    def close(self) -> None:
        for pool in self.parts():
            pool.close()
