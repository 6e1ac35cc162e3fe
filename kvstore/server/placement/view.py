"""A read-only picture of the placement core, for operators and tests (which read no
private state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.tiers.base import TierUsage

if TYPE_CHECKING:
    from kvstore.server.placement.core import Placement


@dataclass(frozen=True)
class CoreView:
    num_leases: int
    num_allocations: int
    num_expiry_entries: int   # one per live lease or allocation, however often renewed
    pinned: frozenset[bytes]  # keys held for callers: leases, allocations, acquisitions under way
    moving: frozenset[bytes]  # keys held by the server's own moves in flight (demotion, deletion)
    num_hinted: int           # keys with an announced use still ahead
    num_detached: int         # landing and pool slots of removed (or quarantined) pages kept for their readers
    tiers: dict[str, TierUsage]
    lease_ids: frozenset[bytes]
    leaned: frozenset[bytes] = frozenset()  # parents open allocations lean on (evicted after other pages, DESIGN §6)

    @classmethod
    def of(cls, core: Placement) -> CoreView:
        """Called with the core's lock held."""
        counts = core.leases.counts()
        return cls(counts.num_leases, counts.num_allocations, counts.num_expiry_entries, counts.pinned, counts.moving,
                   core.residence.landing_orders.num_hinted(), core.residence.num_detached(), {t.name: t.usage() for t in core.tiers},
                   counts.lease_ids, counts.leaned)

    @property
    def idle(self) -> bool:
        """Nothing held for any caller: no lease, allocation, pin, parent leaned on or slot kept for a reader."""
        return not (self.num_leases or self.num_allocations or self.pinned or self.leaned or self.num_detached)
