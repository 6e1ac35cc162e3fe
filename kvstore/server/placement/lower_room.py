"""Room in the tiers below the landing tier: evicting their victims (the delete outside the
core's lock) and the ssd shares (what writing down asks of a page's namespace). Mixed
into ``moves.Mover``, which writes pages down into the room made here."""

from __future__ import annotations

import logging
import threading
from collections.abc import Container

from kvstore.directory import Directory
from kvstore.errors import MetadataFull
from kvstore.page import PageHeader
from kvstore.server.admission import AdmittedTier
from kvstore.server.leases import LeaseTable
from kvstore.server.metrics import Metrics
from kvstore.server.placement.residence import Residence
from kvstore.server.placement.shares import NamespaceShares

logger = logging.getLogger(__name__)


class LowerRoom:
    """Lock held by every method (released around a delete)."""

    lock: threading.Lock
    residence: Residence
    lower: list[AdmittedTier]
    leases: LeaseTable
    directory: Directory
    metrics: Metrics
    node: str
    shares: NamespaceShares | None

    def _target(self, tier: int) -> AdmittedTier:
        return self.lower[tier - 1]

    def _reserve_lower(self, tier: int, payload_bytes: int) -> int | None:
        while True:
            slot = self._target(tier).reserve(payload_bytes)
            if slot is not None or not self._evict_lower(tier, self.leases.pins, payload_bytes):
                return slot

    def _evict_lower(self, tier: int, skip: Container[bytes], payload_bytes: int) -> bool:
        """Evicts the next victim of ``tier`` not in ``skip``; False when there is none or its
        delete failed. Lock held; released during the delete."""
        target = self._target(tier)
        victim = self.residence.orders[tier].of().victim(skip, payload_bytes)
        if victim is None:
            return False
        self.residence.doom(victim, tier)  # not served while it goes
        self.leases.pin([victim], move=True)
        deleted = False
        self.lock.release()
        try:
            target.delete([victim], evicted=True)
            deleted = True
        except (OSError, MetadataFull) as exc:  # a full index cannot even record a delete: no room
            logger.warning("%s tier: cannot evict %s: %s", target.name, victim.hex(), exc)
        finally:
            self.lock.acquire()
            self.residence.revive(victim, tier)  # gone, or still there and live
            self.residence.released(self.leases.unpin([victim], move=True))
        if not deleted:
            return False
        self.directory.remove(victim, self.node, target.name)
        self.metrics.evictions.labels(target.name).inc()
        return True

    def _share_room(self, tier: int, header: PageHeader, why: list[str]) -> bool:
        """Lock held: whether the share the page's namespace counts against takes it in ``tier``
        (write budget, then bytes). A full share's own coldest unpinned pages there make room,
        never another share's; False (the reason in ``why``) when they cannot."""
        shares, target, ns = self.shares, self._target(tier), header.namespace_id
        if shares is None or tier != 1:
            return True
        cost = target.write_cost(header.payload_bytes)
        refusal = shares.write_refused(ns, cost, target.name)
        if refusal is not None:
            why.append(refusal)
            return False
        if not target.budget.can_take(cost):
            return True  # the drive's budget refuses it next: nothing of the share's is evicted for it
        skip = None
        while shares.over(ns, header.payload_bytes):
            skip = skip or shares.own(ns, self.leases.pins)
            if not self._evict_lower(tier, skip, header.payload_bytes):
                why.append(shares.full(ns, target.name))
                return False
        return True

