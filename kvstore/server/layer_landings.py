"""Layer-wise handoff state (DESIGN §12.7, layer-wise pushes). At the prefill node,
``written_slots``: what a layer-wise save's renewal names, for cluster/layer_pushes.py to push.
At the decode node, ``LayerLanding``: one handoff's slots, fetched into and hashed range by range
as the prefill node says its layers are written; at the Push that names the pages once stored, the rest of each comes over the
data plane, and a slot whose whole page matches the holder's checksum is committed (a checked
copy); the rest of the allocation goes back, and those pages come whole as before.

More: kvstore/server/README.md (### layer_landings.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import KVStoreError
from kvstore.page import LayoutDesc
from kvstore.pagecopy import running_checksum

if TYPE_CHECKING:
    from kvstore.server.cluster.landing import Landing
    from kvstore.server.placement import Placement

logger = logging.getLogger(__name__)


@dataclass
class WrittenSlots:
    """An allocation not committed yet, as its writer's renewal found it."""

    namespace_id: bytes
    layout: LayoutDesc
    keys: list[bytes]  # those with a slot, in the allocation's order


def written_slots(core: Placement, allocation_id: bytes, owner: str) -> WrittenSlots | None:
    """The allocation ``allocation_id`` of ``owner``; None when it is gone (committed, aborted, expired)."""
    with core.keeper.lock:
        alloc = core.leases.allocation(allocation_id)
        if alloc is None or alloc.owner != owner:
            return None
        return WrittenSlots(alloc.namespace_id, alloc.layout, [k for k in alloc.keys if k in alloc.slots])


@dataclass
class _Slot:
    allocation_id: bytes
    landing: Landing
    layout: LayoutDesc
    landed: int = 0  # leading bytes of the page written into the slot
    digest: Any = field(default_factory=running_checksum)  # of those bytes, fed as they land

    def restart(self) -> None:
        self.landed, self.digest = 0, running_checksum()


POISONED = -1  # a slot's ``landed`` once it may hold bytes of a page other than the holder's: never committed
Rest = Callable[[list[bytes], list[memoryview], int], list[int]]  # (keys, views, offset) -> checksums of the leading arrived
Pull = Callable[[list[bytes], list[memoryview]], list[bool]]  # (keys, views) -> whether each range arrived


class LayerLanding:
    """One handoff's slots at the decode node. Its lock is held across every write into them and
    across their give-back, so that no byte is written into a slot given back (perhaps another
    page's since); each write renews the allocation first, so that it does not expire under it."""

    def __init__(self, core: Placement, closed: bool = False) -> None:
        self.core = core
        self._lock = threading.Lock()
        self._slots: dict[bytes, _Slot] = {}
        self._kept: set[bytes] = set()  # allocations kept back (``_keep_back``)
        self._closed = closed

    def land(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes], offset: int, length: int, generation: int,
             landing_for: Callable[[list[bytes]], Landing], pull: Pull) -> int:
        """Fetches each page's range ``[offset, offset + length)`` into its slot (``pull``: from the
        holder's pages not stored yet; slots made for the pages that start at 0 and have none,
        ``landing_for`` charges them) and hashes it. A range at 0 starts a slot again (a save
        retried); one that does not continue its slot's bytes, reaches the page's end (the last
        layer comes by ``commit``'s fetch of stored pages) or names another layout is not fetched.
        Returns how many landed."""
        with self._lock:
            if self._closed:
                return 0
            new = [key for key in keys if key not in self._slots]
            if new and offset == 0:
                self._allocate(namespace_id, layout, new, generation, landing_for(new))
            wanted: list[tuple[bytes, _Slot]] = []
            for key in keys:
                slot = self._slots.get(key)
                if slot is None or slot.landed == POISONED or offset + length >= layout.page_bytes:
                    continue
                if slot.layout != layout:  # a save retried in another layout: this slot is never committed
                    slot.landed = POISONED
                    continue
                if offset == 0:
                    slot.restart()
                if slot.landed == offset:
                    wanted.append((key, slot))
            views = self._views(wanted, offset, length)
            try:
                try:
                    arrived = pull([key for key, _ in wanted], views) if views else []
                except KVStoreError as exc:
                    if not _destinations_in_use(exc):
                        raise
                    self._keep_back(wanted)
                    return 0
                landed = 0
                for (_, slot), view, ok in zip(wanted, views, arrived):
                    if ok:
                        slot.digest.update(view)
                        slot.landed += length
                        landed += 1
            finally:
                for view in views:
                    view.release()
            self.core.metrics.handoff_layer_bytes.labels("landed").inc(landed * length)
            return landed

    def _views(self, wanted: list[tuple[bytes, _Slot]], offset: int, length: int = 0) -> list[memoryview]:
        """Where each range lands (``length`` 0: to the page's end), each allocation renewed first
        (its own term from now: it outlives the fetch); none when one has expired (its slots are
        dropped: those pages come whole)."""
        views: list[memoryview] = []
        try:
            for allocation_id in {slot.allocation_id for _, slot in wanted}:
                self.core.renew(allocation_id, 0)
            for key, slot in wanted:
                whole = self.core.slot_view(slot.allocation_id, key)
                views.append(whole[offset : offset + length] if length else whole[offset:])
                whole.release()
            return views
        except KVStoreError:
            for view in views:
                view.release()
            for allocation_id in {slot.allocation_id for _, slot in wanted}:
                if self.core.leases.allocation(allocation_id) is None:
                    self._drop(allocation_id)
            return []

    def _allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes], generation: int, landing: Landing) -> None:
        try:
            allocation_id, slots = landing.allocate(namespace_id, layout, keys, generation)
        except KVStoreError as exc:  # no room, another layout or generation: these pages come whole at the Push
            logger.info("no landing for %d pages' layers: %s", len(keys), exc)
            return
        for key, slot in slots:
            if slot is not None:
                self._slots[key] = _Slot(allocation_id, landing, layout)

    def commit(self, keys: list[bytes], rest: Rest) -> int:
        """At the Push of ``keys`` (stored at the holder now): the rest of each slot that holds a
        leading part of its page is fetched (``rest``: unhashed, from that offset, of this node's
        generation), the page's checksum finished over it, and the slots whose page matches the
        holder's stored checksum are committed; every allocation they touch is ended (its other
        slots given back: those pages come whole). Returns how many pages it committed."""
        with self._lock:
            touched: dict[bytes, tuple[Landing, list[bytes], list[int]]] = {}
            waiting: dict[int, list[bytes]] = {}  # offset -> the slots whose rest starts there
            for key in keys:
                if (slot := self._slots.get(key)) is not None:
                    touched.setdefault(slot.allocation_id, (slot.landing, [], []))
                    if 0 < slot.landed < slot.layout.page_bytes:
                        waiting.setdefault(slot.landed, []).append(key)
            for offset, group in waiting.items():
                self._finish(group, offset, rest, touched)
            committed = 0
            for allocation_id, (landing, ready, sums) in touched.items():
                if allocation_id in self._kept:
                    continue  # a fetch may still write into its slots: neither committed nor given back
                committed += self._commit(allocation_id, landing, ready, sums)
                self._drop(allocation_id)
            return committed

    def _finish(self, keys: list[bytes], offset: int, rest: Rest, touched: dict[bytes, tuple[Landing, list[bytes], list[int]]]) -> None:
        """Fetches the rest of ``keys``' slots into them; those whose page then matches go to ``touched``'s ready lists."""
        wanted = [(key, self._slots[key]) for key in keys]
        views = self._views(wanted, offset)
        if not views:
            return
        try:
            try:
                sums = rest(keys, views, offset)
            except KVStoreError as exc:
                if not _destinations_in_use(exc):
                    raise
                self._keep_back(wanted)
                return
            for (key, slot), view, stored in zip(wanted, views, sums):
                slot.digest.update(view)
                if slot.digest.intdigest() == stored:  # every byte checked: committed as a checked copy
                    _, ready, ready_sums = touched[slot.allocation_id]
                    ready.append(key)
                    ready_sums.append(stored)
                else:
                    logger.info("handed-off page %s assembled from its layers does not match its checksum; fetched whole",
                                key.hex())
        finally:
            for view in views:
                view.release()

    def _commit(self, allocation_id: bytes, landing: Landing, keys: list[bytes], checksums: list[int]) -> int:
        if not keys:
            self.core.abort(allocation_id)
            return 0
        try:
            landing.commit(allocation_id, keys, checksums)
        except KVStoreError as exc:  # expired, a generation moved on: those pages come whole (or not at all)
            logger.info("layers of %d handed-off pages not committed: %s", len(keys), exc)
            self.core.abort(allocation_id)
            return 0
        self.core.metrics.handoff_layer_pages.inc(len(keys))
        return len(keys)

    def _keep_back(self, wanted: list[tuple[bytes, _Slot]]) -> None:
        """A fetch into these slots was abandoned while the transport may still write into them: their
        allocations are not given back but kept for the longest term the lease table allows (a late
        receive lands in them, not in another page's slot), then reaped; this landing forgets them."""
        longest = max(self.core.leases.max_lease_ms, self.core.leases.allocation_ttl_ms)
        for allocation_id in {slot.allocation_id for _, slot in wanted}:
            try:
                self.core.renew(allocation_id, longest)
            except KVStoreError:
                pass  # gone already
            self._kept.add(allocation_id)
            self._drop(allocation_id)
        logger.error("%d handoff slots kept back: a fetch into them may still write", len(wanted))

    def _drop(self, allocation_id: bytes) -> None:
        for key in [k for k, s in self._slots.items() if s.allocation_id == allocation_id]:
            del self._slots[key]

    def close(self) -> None:
        """The handoff's marker went: every slot not committed is given back."""
        with self._lock:
            self._closed = True
            allocations = {slot.allocation_id for slot in self._slots.values()}
            self._slots.clear()
            for allocation_id in allocations:
                self.core.abort(allocation_id)


def _destinations_in_use(exc: BaseException) -> bool:
    """Whether a fetch ended with its destinations perhaps still written into (cluster mode's
    ``DestinationsInUse``; imported here only when one was raised: a single node loads no cluster code)."""
    from kvstore.cluster.cluster_errors import DestinationsInUse

    return isinstance(exc, DestinationsInUse)
