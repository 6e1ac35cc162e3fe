"""The core's lock, and what every operation does around it: expiry of leases, allocations
and hints, learning from uses, and the removals owed, done after the lock is let go."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvstore.errors import MetadataFull
from kvstore.server.admission import AdmittedTier
from kvstore.server.leases import Allocation, LeaseTable
from kvstore.server.placement.residence import Owed, Residence
from kvstore.tiers.base import Tier

logger = logging.getLogger(__name__)


class Housekeeper:
    def __init__(self, residence: Residence, leases: LeaseTable, lower: list[AdmittedTier], clock: Callable[[], float]) -> None:
        self.lock = threading.Lock()  # in-memory placement state only; never held over disk I/O
        self.residence = residence
        self.leases = leases
        self.lower = lower
        self.clock = clock

    @contextmanager
    def critical(self) -> Iterator[None]:
        """Holds the lock; on the way out, lower-tier copies owed a removal meanwhile are
        deleted (or quarantined) without it."""
        self.lock.acquire()
        try:
            yield
        finally:
            owed = self.residence.take_owed()
            self.lock.release()
            while owed:
                owed = self._settle(owed)

    def _settle(self, owed: list[Owed]) -> list[Owed]:
        """Does owed removals, each key pinned meanwhile; returns what became owed since."""
        done = []
        with self.lock:  # a copy written again since it was doomed (revived) is not this removal's to delete
            revived = [item for item in owed if not item.reason and not self.residence.doomed(item.key, item.tier)]
            for item in revived:
                self.residence.released(self.leases.unpin([item.key], move=True))
            owed = [item for item in owed if item not in revived]
        for item in owed:
            if not item.reason:
                continue
            part = self.residence.tiers[item.tier].part_of(item.key)  # None: gone already
            try:
                if part is not None:
                    part.quarantine(item.key, item.reason)
                done.append((item, True))
            except (OSError, MetadataFull) as exc:
                logger.error("%s tier: cannot quarantine page %s (%s); it is never served again",
                             self.residence.tiers[item.tier].name, item.key.hex(), exc)
                done.append((item, False))
        # the deletes: one index transaction (synced) per tier part, not one a page (an invalidated
        # namespace owes all its lower copies at once)
        deletes: dict[tuple[int, bytes], list[Owed]] = {}
        for item in owed:
            if not item.reason:
                deletes.setdefault((item.tier, item.key), []).append(item)
        for index, part, batch in self._by_part(list(deletes)):
            for keys, ok in self._delete(part, batch, self.residence.tiers[index].name):
                done += [(item, ok) for key in keys for item in deletes.pop((index, key))]
        done += [(item, True) for items in deletes.values() for item in items]  # gone already
        with self.lock:
            for item, ok in done:
                self.residence.settled(item, ok)
                self.residence.released(self.leases.unpin([item.key], move=True))
            return self.residence.take_owed()

    @staticmethod
    def _delete(part: Tier, keys: list[bytes], tier_name: str) -> list[tuple[list[bytes], bool]]:
        """Deletes ``keys`` from ``part`` in one index transaction: [(keys, whether deleted)]. One
        refused whole for a full index is done a key at a time (an LMDB transaction copies the pages
        it touches before it frees any: many deletes at once need room a full map lacks, one does not)."""
        try:
            part.delete(keys)
            return [(keys, True)]
        except MetadataFull as exc:
            if len(keys) > 1:
                return [done for key in keys for done in Housekeeper._delete(part, [key], tier_name)]
            error: Exception = exc
        except OSError as exc:
            error = exc
        logger.error("%s tier: cannot remove %d pages (%s); they are never served again", tier_name, len(keys), error)
        return [(keys, False)]

    def settle_owed(self) -> None:
        """Lock held: does the removals owed so far now, letting go of the lock meanwhile."""
        owed = self.residence.take_owed()
        if not owed:
            return
        self.lock.release()
        try:
            while owed:
                owed = self._settle(owed)
        finally:
            self.lock.acquire()

    def delete_lower_first(self, keys: list[bytes], tier_name: str = "") -> None:
        """Deletes the unpinned lower-tier copies of ``keys`` (only in ``tier_name`` when
        given) BEFORE the caller forgets them: a delete the tier refuses (a full index)
        raises MetadataFull with nothing changed, so memory and disk never disagree (an I/O
        error leaves the copy stuck, never served, as an owed removal does). Each key
        is doomed and pinned meanwhile; the deletes run without the lock. Readers' leases hold
        landing copies and pool slots (``Promoter.placed``), not lower copies, so a leased key's
        lower copies go now; a key a move holds is left to the removal owed at its last unpin.
        Upper copies are the caller's to drop after (``Residence.drop``: at the last pin)."""
        todo: list[tuple[int, bytes]] = []
        with self.lock:
            for key in keys:
                if self.leases.moving(key):  # a move reads or writes a lower copy now: removed at its unpin
                    continue
                for index in range(1, len(self.residence.tiers)):
                    tier = self.residence.tiers[index]
                    if index in self.residence.upper:
                        continue
                    if (not tier_name or tier.name == tier_name) and self.residence.has(key, index):
                        self.residence.doom(key, index)
                        todo.append((index, key))
            self.leases.pin([key for _, key in todo], move=True)
        done: list[tuple[int, bytes]] = []
        failed: list[tuple[int, bytes]] = []
        try:
            for index, part, batch in self._by_part(todo):
                try:
                    part.delete(batch)  # one index transaction: all or nothing
                    done += [(index, key) for key in batch]
                except OSError as exc:  # a failing device: the removal goes on, the copies are never served
                    logger.error("%s tier: cannot remove %d pages (%s); they are never served again",
                                 self.residence.tiers[index].name, len(batch), exc)
                    failed += [(index, key) for key in batch]
        finally:
            with self.lock:
                for index, key in todo:
                    if (index, key) in done or (index, key) in failed:
                        self.residence.settled(Owed(index, key), (index, key) in done)
                    else:
                        self.residence.revive(key, index)
                self.residence.released(self.leases.unpin([key for _, key in todo], move=True))

    def _by_part(self, todo: list[tuple[int, bytes]]) -> list[tuple[int, Tier, list[bytes]]]:
        """``todo``'s keys by the tier and the part of it that holds them (a lower tier is one part)."""
        batches: dict[tuple[int, int], tuple[int, Tier, list[bytes]]] = {}
        for index, key in todo:
            part = self.residence.tiers[index].part_of(key)
            if part is not None:
                batches.setdefault((index, id(part)), (index, part, []))[2].append(key)
        return sorted(batches.values(), key=lambda batch: batch[0])

    def reap(self) -> None:
        """Lock held: forgets stale hints, ends expired leases and allocations."""
        self.residence.landing_orders.expire_hints(self.clock())
        free, allocations = self.leases.expired()
        self.residence.released(free)
        for alloc in allocations:
            self.give_back(alloc)

    def give_back(self, alloc: Allocation) -> None:
        """Lock held: frees an allocation's reserved slots and its pins on stored pages."""
        self.free_slots(list(alloc.slots.values()))
        self.let_go(alloc)

    def let_go(self, alloc: Allocation, also: list[bytes] | None = None) -> None:
        """Lock held: drops an allocation's pins (stored keys, parent) and one pin of ``also``."""
        self.residence.released(self.leases.let_go(alloc) + self.leases.unpin(also or []))

    def free_slots(self, slots: list[int]) -> None:
        for slot in slots:
            self.residence.landing.at(slot).unreserve(slot)

    def unpin(self, keys: list[bytes]) -> None:
        self.residence.released(self.leases.unpin(keys))

    def learn(self, key: bytes) -> None:
        """Lock held: a use of ``key``; admission learns from it, a hint for it is fulfilled."""
        for target in self.lower:
            target.learn(key)
        self.residence.landing_orders.used(key, self.clock())
