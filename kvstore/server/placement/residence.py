"""Which tier holds a live copy of each page, which goes first (each tier's eviction orders,
orders.py, which its tier tells what it stores), and the removals still owed.

More: kvstore/server/placement/README.md (### residence.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.server.leases import LeaseTable
from kvstore.server.placement.orders import LandingOrders, Orders
from kvstore.tiers.base import LandingPart, Tier
from kvstore.tiers.owner_parts import OwnerParts

logger = logging.getLogger(__name__)

LANDING = 0  # tiers[0] is where pages land; tiers[1:] are demotion targets


@dataclass(frozen=True)
class Owed:
    """A copy to delete (or, with a reason, to quarantine) outside the core's lock."""

    tier: int
    key: bytes
    reason: str = ""


class Residence:
    def __init__(self, landing: OwnerParts[LandingPart], lower: list[Tier], leases: LeaseTable,
                 upper: list[OwnerParts[Tier]], orders: list[Orders]) -> None:
        self.landing = landing
        # Upper tiers (faster than the landing tier: hbm) go last, so that the index of the
        # landing tier and of each lower tier is the same with or without them.
        self.tiers: list[OwnerParts[Tier]] = [landing, *map(OwnerParts.one, lower), *upper]  # type: ignore[list-item]
        self.upper = list(range(1 + len(lower), len(self.tiers)))
        self.orders = orders  # orders[i]: the eviction orders of tiers[i]'s parts
        assert isinstance(orders[LANDING], LandingOrders) and len(orders) == len(self.tiers)
        self.landing_orders: LandingOrders = orders[LANDING]
        self._read_order = [*self.upper, *range(1, 1 + len(lower))]  # fastest first
        self.leases = leases
        self._doomed: set[tuple[bytes, int]] = set()  # lower-tier copies removed, not yet deleted
        self._stuck: set[tuple[bytes, int]] = set()   # ... whose delete failed: never served, never retried
        self._detached: dict[bytes, list[tuple[int, int]]] = {}  # (tier, slot) of removed in-place copies, freed once unpinned
        self._owed: list[Owed] = []

    def part(self, key: bytes, tier: int) -> Tier | None:
        """The part of ``tiers[tier]`` that holds ``key``, live or not (None: none does)."""
        part = self.tiers[tier].part_of(key)
        return part if part is not None and part.contains(key) else None

    def has(self, key: bytes, tier: int) -> bool:
        """Whether ``tiers[tier]`` holds a live copy of ``key`` (``part`` inlined: the core asks it of every key)."""
        part = self.tiers[tier].part_of(key)
        return part is not None and part.contains(key) and (tier == LANDING or (key, tier) not in self._doomed)

    def doomed(self, key: bytes, tier: int) -> bool:
        """Whether a removed copy of ``key`` in ``tiers[tier]`` waits to be deleted."""
        return (key, tier) in self._doomed

    def stored(self, key: bytes) -> bool:
        return any(self.has(key, i) for i in range(len(self.tiers)))

    def holder(self, key: bytes) -> int | None:
        """The fastest tier but the landing one with a live copy of ``key``."""
        return next((i for i in self._read_order if self.has(key, i)), None)

    def index(self, name: str) -> int | None:
        return next((i for i, tier in enumerate(self.tiers) if tier.name == name), None)

    # -- removal -------------------------------------------------------------------------

    def drop(self, key: bytes, tier: int) -> None:
        """Frees this node's copy of ``key`` in ``tiers[tier]`` (already out of the
        directory) now, or once its last pin goes."""
        if tier == LANDING:
            arena: LandingPart | None = self.landing.part_of(key)
            if arena is None:
                return
            if not self.leases.pinned(key):
                arena.delete([key])
            else:
                self.keep_detached(key, arena.detach(key))
            return
        part = self.part(key, tier)
        if part is None or (key, tier) in self._doomed:
            return
        if tier in self.upper and self.leases.pinned(key):  # an engine reads its pool slot in place (Promoter.placed)
            self.keep_detached(key, part.detach(key), tier)  # type: ignore[attr-defined]
            return
        self._doomed.add((key, tier))
        if not self.leases.pinned(key):
            self._owe(Owed(tier, key))

    def keep_detached(self, key: bytes, slot: int | None, tier: int = LANDING) -> None:
        """``key``'s ``slot`` in ``tiers[tier]`` (a landing slot, or a pool's), out of its part's
        index, is freed once its last pin goes (``released``): its readers still read it there."""
        if slot is not None:
            self._detached.setdefault(key, []).append((tier, slot))

    def quarantine(self, key: bytes, tier: int, reason: str) -> None:
        """A lower-tier copy failed a check: never served again, quarantined outside the lock.
        An upper one (memory) is quarantined now, as ``quarantine_held`` does."""
        if tier in self.upper:
            self.quarantine_held(key, tier, reason)
            return
        self._doomed.add((key, tier))
        self._owe(Owed(tier, key, reason))

    def quarantine_held(self, key: bytes, tier: int, reason: str) -> None:
        """A copy read in place (a landing slot, a pool slot a lease named) failed a check: out of
        its part now and listed; its slot is freed at once, or at the last pin (``keep_detached``)."""
        part = self.part(key, tier)
        if part is None:
            return
        if self.leases.pinned(key):
            self.keep_detached(key, part.quarantine_detached(key, reason), tier)  # type: ignore[attr-defined]
        else:
            part.quarantine(key, reason)

    def doom(self, key: bytes, tier: int) -> None:
        """Marks a copy as leaving (not served) while the caller deletes it itself."""
        self._doomed.add((key, tier))

    def revive(self, key: bytes, tier: int) -> None:
        """A copy was written again (a fresh one replaces a doomed one) or its delete failed
        and it stays where it is, published again."""
        self._doomed.discard((key, tier))
        self._stuck.discard((key, tier))

    def released(self, keys: list[bytes]) -> None:
        """``keys`` lost their last pin: what waited for that happens (or is owed) now."""
        for key in keys:
            for tier, slot in self._detached.pop(key, ()):
                self.tiers[tier].at(slot).unreserve(slot)
            for tier in range(1, len(self.tiers)):
                if (key, tier) in self._doomed and (key, tier) not in self._stuck:
                    self._owe(Owed(tier, key))

    def _owe(self, owed: Owed) -> None:
        self.leases.pin([owed.key], move=True)  # nobody writes or reads the key while its copy goes
        self._owed.append(owed)

    def take_owed(self) -> list[Owed]:
        owed, self._owed = self._owed, []
        return owed

    def settled(self, owed: Owed, ok: bool) -> None:
        """An owed removal was done (``ok``) or failed; its pin is the caller's to drop."""
        if ok or self.part(owed.key, owed.tier) is None:
            self._doomed.discard((owed.key, owed.tier))
            self._stuck.discard((owed.key, owed.tier))
        else:
            self._stuck.add((owed.key, owed.tier))

    def num_detached(self) -> int:
        return sum(len(slots) for slots in self._detached.values())


def leading(keys: list[bytes], held: Callable[[bytes], bool]) -> list[bytes]:
    """The leading keys for which ``held`` is true."""
    for i, key in enumerate(keys):
        if not held(key):
            return keys[:i]
    return keys
