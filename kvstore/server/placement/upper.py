"""The tier above the landing tier (hbm): pages an engine will read on its device are
promoted into it, and its coldest pages are demoted back down to make room.

More: kvstore/server/placement/README.md (### upper.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kvstore.device_ops import PoolHandout
from kvstore.directory import Directory
from kvstore.errors import PageCorrupt, TierFull
from kvstore.page import PageHeader
from kvstore.server.metrics import Metrics
from kvstore.server.placement.housekeeping import Housekeeper
from kvstore.server.placement.moves import Mover
from kvstore.server.placement.reads import AcquiredPage
from kvstore.server.placement.residence import LANDING
from kvstore.tiers.base import ReadResult, Tier
from kvstore.tiers.owner_parts import OwnerParts

logger = logging.getLogger(__name__)


class Pool(Tier, Protocol):
    """One owner's part of the upper tier (an hbm pool, tiers/pools.py)."""

    owner: str
    handout: PoolHandout  # what its owner's engines map: its token names it in an Acquire answer

    def fits(self, page_bytes: int) -> bool: ...

    def offset(self, slot: int) -> int:
        """Where ``slot`` lies in the pool an engine maps."""
        ...


class Promoter:
    def __init__(self, keeper: Housekeeper, moves: Mover, directory: Directory, node: str, metrics: Metrics,
                 owner_of: Callable[[bytes], str], quarantine: Callable[[PageHeader, str, int | None], None]) -> None:
        self.owner_of = owner_of  # namespace id -> the owner of the arena a page demoted from hbm goes to
        self.quarantine = quarantine  # a landing page found damaged: Reader.quarantine_landing, lower copies checked too (DESIGN §4)
        self.keeper = keeper
        self.lock = keeper.lock
        self.residence = keeper.residence
        self.leases = keeper.leases
        self.landing = keeper.residence.landing
        self.moves = moves
        self.directory = directory
        self.node = node
        self.metrics = metrics
        self.index = self.residence.upper[0] if self.residence.upper else None  # the fastest upper tier
        self._promoting: set[bytes] = set()

    @property
    def tier(self) -> OwnerParts[Pool]:
        """The upper tier: a map of pools by owner."""
        assert self.index is not None
        return self.residence.tiers[self.index]  # type: ignore[return-value]

    def promoted(self, ident: bytes, pages: list[AcquiredPage], device: bool) -> tuple[bytes, list[AcquiredPage]]:
        """An acquire's answer, once its pages were promoted (``promote``) when the engine
        asked for ``device`` placement; as it is otherwise."""
        if device:
            self.promote(pages)
        return ident, pages

    def placed(self, pages: list[AcquiredPage]) -> tuple[bytes, list[int | None]]:
        """Where leased ``pages`` are in their owner's pool: its token and each page's offset
        there (None: not in it). The lease keeps them there (a pinned page is no victim)."""
        if self.index is None or not pages:
            return b"", [None] * len(pages)
        tier, up = self.tier, self.index
        with self.keeper.critical():
            pools = [tier.part_of(p.key) if self.residence.has(p.key, up) else None for p in pages]
            held = [pool.find(p.key) if pool is not None else None for pool, p in zip(pools, pages)]
        slots = [found[0] if found is not None else None for found in held]
        token = next((tier.at(slot).handout.token for slot in slots if slot is not None), b"")
        return token, [None if slot is None else tier.at(slot).offset(slot) for slot in slots]

    def promote(self, pages: list[AcquiredPage]) -> int:
        """Copies leased landing pages (the caller's lease keeps their slots) into the upper
        tier; returns how many it published there. A page that does not fit, or that fails
        its check on the way, stays where it is. Without an upper tier: nothing."""
        if self.index is None or not pages:
            return 0
        up, tier = self.index, self.tier
        try:
            pool = tier.part(self.owner_of(pages[0].header.namespace_id))  # one namespace: one owner, one pool
        except TierFull as exc:  # the device cannot hold another pool: the engine reads from its arena
            logger.warning("pages not promoted: %s", exc)
            return 0
        placed: list[tuple[int, AcquiredPage]] = []
        making_room: bytes | None = None  # the key whose slot is being found
        with self.keeper.critical():
            try:
                for page in pages:
                    key, size = page.key, page.header.payload_bytes
                    # a key a move holds may have a copy being deleted here: not written over it
                    if self.residence.has(key, up) or key in self._promoting or self.leases.moving(key) or not pool.fits(size):
                        continue
                    self._promoting.add(key)
                    making_room = key
                    slot = self._make_room(size, pool)
                    making_room = None
                    if slot is None:
                        self._promoting.discard(key)
                        break
                    placed.append((slot, page))
            except BaseException:
                self._promoting.difference_update([page.key for _, page in placed] + ([making_room] if making_room else []))
                for slot, _ in placed:
                    pool.unreserve(slot)
                raise
        written: list[tuple[int, PageHeader]] = []
        try:
            for slot, page in placed:
                source = self.landing.at(page.slot).view(page.slot, page.header.payload_bytes)
                try:
                    page.header.verify_payload(source, page.header.payload_bytes)
                except PageCorrupt as exc:  # damaged in the arena: not copied up, and dropped as any reader's find is
                    logger.warning("not promoting page %s: %s", page.key.hex(), exc)
                    self.quarantine(page.header, f"on promotion: {exc}", page.slot)
                    continue
                pool.write([(slot, page.header, source)])
                written.append((slot, page.header))
            pool.commit(written)
        except OSError as exc:
            logger.error("promotion into %s failed (%s); the pages stay below", tier.name, exc)
            written = []
        except Exception:
            logger.exception("promotion into %s failed; the pages stay below", tier.name)
            written = []
        with self.keeper.critical():
            return self._publish(placed, written)

    def _publish(self, placed: list[tuple[int, AcquiredPage]], written: list[tuple[int, PageHeader]]) -> int:
        """Lock held: publishes what was committed; gives back the slots of the rest."""
        up, tier = self.index, self.tier
        assert up is not None
        committed = {slot for slot, _ in written}
        for slot, page in placed:
            self._promoting.discard(page.key)
            if slot not in committed:
                tier.at(slot).unreserve(slot)
        listed: set[bytes] = set()
        for slot, header in written:
            record = (header.key, self.node, tier.name, header.payload_bytes)
            if header.key in self.directory.publish_listed(header.namespace_id, [record], header.generation):
                listed.add(header.key)
                self.residence.revive(header.key, up)
                self.metrics.promotions.labels(self.landing.name).inc()  # labelled by the tier it left, as reads.py does
                self.metrics.bytes_in.labels(tier.name).inc(header.payload_bytes)
            else:
                self.residence.drop(header.key, up)  # removed while it was copied: not resurrected
        return len(listed)

    # -- room in the upper tier (lock held; released while a victim is demoted) ----------

    def _make_room(self, page_bytes: int, pool: Pool) -> int | None:
        while True:
            slot = pool.reserve(page_bytes)
            if slot is not None or not self._evict_one(page_bytes, pool):
                return slot

    def _evict_one(self, page_bytes: int, pool: Pool) -> bool:
        """Frees the next victim of ``pool`` (one owner's), demoting it to the landing tier
        first when no other tier holds it; False when every page there is pinned or in flight."""
        up, tier = self.index, self.tier
        assert up is not None
        skip = _Either(self.leases.pins, self._promoting)
        victim = self.residence.orders[up].of(pool.owner).victim(skip, page_bytes)
        if victim is None:
            return False
        found = pool.find(victim)
        header = found[1] if found is not None else None
        elsewhere = any(self.residence.has(victim, i) for i in range(len(self.residence.tiers)) if i != up)
        if header is not None and not elsewhere:
            self._demote(victim, header, pool)
        if self.residence.has(victim, up) and not self.leases.pinned(victim):
            try:
                pool.delete([victim], evicted=True)
            except OSError as exc:  # a memory tier does not fail here, a fault-injecting wrapper may
                logger.error("%s tier: cannot evict %s: %s", tier.name, victim.hex(), exc)
                return False
            self.directory.remove(victim, self.node, tier.name)
            self.metrics.evictions.labels(tier.name).inc()
        return True

    def _demote(self, key: bytes, header: PageHeader, pool: Pool) -> None:
        """Lock held (released for the copy): reads the only copy of ``key`` (in ``pool``) into
        a slot of its owner's arena and publishes it there (a page no slot fits leaves the cache)."""
        up, tier = self.index, self.tier
        arena = self.landing.part(self.owner_of(header.namespace_id))
        if not arena.fits(header.payload_bytes):
            return
        slot = self.moves.make_room(header.payload_bytes, arena)
        if slot is None:
            return  # every landing page is pinned: the page leaves the cache
        self.leases.pin([key], move=True)
        self.lock.release()
        try:
            result = pool.read_into([(key, arena.view(slot, arena.slot_bytes(slot)))])
        except OSError as exc:
            logger.error("%s tier: read of %s failed: %s", tier.name, key.hex(), exc)
            result = ReadResult(0)
        finally:
            self.lock.acquire()
            self.residence.released(self.leases.unpin([key], move=True))
        if result.num_read == 1 and up is not None and self.residence.has(key, up) and not self.residence.has(key, LANDING):
            arena.commit([(slot, header)])
            record = (key, self.node, self.landing.name, header.payload_bytes)
            if key in self.directory.publish_listed(header.namespace_id, [record], header.generation):
                self.metrics.demotions.labels(tier.name).inc()
            else:
                self.residence.drop(key, LANDING)
            return
        arena.unreserve(slot)
        if result.reason and up is not None and self.residence.has(key, up):
            self.residence.quarantine_held(key, up, f"on demotion: {result.reason}")  # a lease may name its slot
            self.metrics.quarantined.labels(tier.name).inc()
            self.directory.remove(key, self.node, tier.name)


class _Either:
    """Membership in either of two containers (pinned keys, keys being promoted)."""

    def __init__(self, first: object, second: set[bytes]) -> None:
        self._first, self._second = first, second

    def __contains__(self, key: object) -> bool:
        return key in self._first or key in self._second  # type: ignore[operator]
