"""What the placement core reports: quarantined pages, stats, a picture of what is where.
Mixed into ``Placement``, whose tiers, residence, lock and reporter it reads."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvstore.page import PageHeader
from kvstore.server.placement.view import CoreView
from kvstore.server.stats import CoreStats, Reporter
from kvstore.tiers.base import Quarantined

if TYPE_CHECKING:
    from kvstore.server.leases import LeaseTable
    from kvstore.server.placement.housekeeping import Housekeeper
    from kvstore.server.placement.residence import Residence
    from kvstore.tiers.base import Tier
    from kvstore.tiers.owner_parts import OwnerParts


class CoreReports:
    tiers: list[OwnerParts[Tier]]
    residence: Residence
    keeper: Housekeeper
    leases: LeaseTable
    reporter: Reporter
    _lock: threading.Lock

    def quarantined(self) -> list[Quarantined]:
        return [q for tier in self.tiers for q in tier.quarantined()]

    def purge_quarantine(self) -> int:
        return sum(len(tier.quarantined(purge=True)) for tier in self.tiers)

    def stats(self) -> CoreStats:
        num_quarantined = len(self.quarantined())  # an index read: outside the lock
        with self.keeper.critical():
            self.keeper.reap()
            return self.reporter.collect(self.leases.counts().num_leases, num_quarantined)

    def view(self) -> CoreView:
        """A read-only picture of what is held and where (for operators and tests)."""
        with self._lock:
            return CoreView.of(self)

    def where(self, key: bytes) -> dict[str, int]:
        """This node's live copies of ``key``: tier name -> slot (arena or file offset)."""
        with self._lock:
            found = {t.name: self.residence.part(key, i).find(key)  # type: ignore[union-attr]  # has: a part holds it
                     for i, t in enumerate(self.tiers) if self.residence.has(key, i)}
        return {name: held[0] for name, held in found.items() if held is not None}

    def page(self, key: bytes) -> PageHeader | None:
        """The header of this node's fastest live copy of ``key``."""
        with self._lock:
            held = next((self.residence.part(key, i).find(key)  # type: ignore[union-attr]  # has: a part holds it
                         for i in range(len(self.tiers)) if self.residence.has(key, i)), None)
        return held[1] if held is not None else None
