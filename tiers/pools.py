"""The hbm tier as one device pool per tenant: a pool follows the host arenas' trust model.

Whoever maps a pool reads and writes every slot in it (a CUDA IPC mapping cannot be made
read-only), so a pool is a trust domain, as an arena is (arenas.py): with tenants each gets
its own, holding only the pages of the namespaces it owns, and the arena socket hands it
only to that tenant's tokens. Without tenants, or with ``--share-arena`` (tenants that trust
each other), there is one pool, as there is one arena.

The placement core still sees one upper tier: a slot number says which pool it is in (pool
``i`` numbers its slots from ``i << POOL_BITS``), a key is in at most one pool (its
namespace's owner's), and what must happen in one owner's pool (reserving a slot) is asked
of that pool, ``part(owner)``; each pool tells its own events (``events(owner)``: the core's
eviction order of that pool). A pool is made at its owner's first use,
of ``--hbm-capacity`` bytes each, and lives as long as the server: engines hold mappings of
it. Without tenants the one pool is made at start, so that a device that cannot hold it
refuses the server at once.

The parts, their slot numbering and the per-key calls are owner_parts.py's (shared with the
host arenas); what is the pools' own is here: how one is made, the token of each.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.config import HbmTierConfig
from kvstore.device_ops import DeviceOps, ops_for_pool
from kvstore.errors import TierFull
from kvstore.tiers.base import UNOWNED, StoreEvents
from kvstore.tiers.hbm import HbmTier, check_device
from kvstore.tiers.owner_parts import PART_BITS, OwnerParts
from kvstore.tiers.slab import round_up

POOL_BITS = PART_BITS  # slot >> POOL_BITS is its pool


class TenantPools(OwnerParts[HbmTier]):
    """The upper tier over one hbm pool per owner (see the module docstring)."""

    name = "hbm"
    what = "hbm pool"

    def __init__(self, config: HbmTierConfig, per_tenant: bool, ops: DeviceOps | None = None,
                 events: Callable[[str], StoreEvents] | None = None) -> None:
        super().__init__()
        self._events = events  # owner -> the events of its pool
        self.config = config
        self.ops = ops or ops_for_pool(check_device(config))
        self.per_tenant = per_tenant
        if not per_tenant:
            self.part(UNOWNED)  # made at start: a device that cannot hold it refuses the server at once

    def _owner(self, owner: str) -> str:
        return owner if self.per_tenant else UNOWNED

    def _make(self, owner: str, base: int) -> HbmTier:
        try:
            return HbmTier(self.config, self.ops, base=base, owner=owner, events=self._events(owner) if self._events else None)
        except (RuntimeError, OSError) as exc:  # out of device memory, or no memory for the emulation
            raise TierFull(f"no hbm pool for tenant {owner!r}: {exc}") from None

    def token_of(self, slot: int) -> bytes:
        """The token of the pool ``slot`` is in (an Acquire answer names it with the offsets)."""
        return self._at(slot).handout.token

    def fits(self, page_bytes: int) -> bool:
        return 0 < round_up(page_bytes) <= self.config.slab_bytes  # every pool's slabs are of this size
