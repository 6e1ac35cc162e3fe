"""Layer-wise handoff state (DESIGN §12.7, layer-wise pushes). At the prefill node,
``written_slots``: what a layer-wise save's renewal names, for cluster/layer_pushes.py to push.
At the decode node, ``LayerLanding``: one handoff's slots, filled range by range as the layers
arrive; the Push that names the pages once stored carries their checksums, and the slots whose
every byte arrived are committed with them, unhashed, noted as from the holder (the copy out of
the arena checks them, DESIGN §4); the rest of the allocation goes back, those pages come whole.

More: kvstore/server/README.md (### layer_landings.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError, LeaseExpired
from kvstore.page import LayoutDesc

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
    landed: int = 0  # leading bytes of the page written into the slot


class LayerLanding:
    """One handoff's slots at the decode node. Its lock is held across every write into them and
    across their give-back, so that no byte is written into a slot given back (perhaps another
    page's since); each write renews the allocation first, so that it does not expire under it."""

    def __init__(self, core: Placement, closed: bool = False) -> None:
        self.core = core
        self._lock = threading.Lock()
        self._slots: dict[bytes, _Slot] = {}
        self._closed = closed

    def land(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes], offset: int, length: int, data: bytes,
             generation: int, landing_for: Callable[[list[bytes]], Landing]) -> int:
        """Writes page i's range ``[offset, offset + length)`` from ``data[i * length:]`` into its
        slot (made for the pages that start at 0 and have none; ``landing_for`` charges them);
        a range that does not continue its slot's bytes is dropped. Returns how many landed."""
        with self._lock:
            if self._closed:
                return 0
            new = [key for key in keys if key not in self._slots]
            if new and offset == 0:
                self._allocate(namespace_id, layout, new, generation, landing_for(new))
            view, renewed, landed = memoryview(data), set(), 0
            for i, key in enumerate(keys):
                slot = self._slots.get(key)
                if slot is None or slot.landed != offset or offset + length > layout.page_bytes:
                    continue
                if slot.allocation_id not in renewed:
                    try:
                        self.core.renew(slot.allocation_id, 0)  # its own term from now: it outlives this write
                    except LeaseExpired:
                        self._drop(slot.allocation_id)
                        continue
                    renewed.add(slot.allocation_id)
                target = self.core.slot_view(slot.allocation_id, key)
                try:
                    target[offset : offset + length] = view[i * length : (i + 1) * length]
                finally:
                    target.release()
                slot.landed += length
                landed += 1
            self.core.metrics.handoff_layer_bytes.labels("landed").inc(landed * length)
            return landed

    def _allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes], generation: int, landing: Landing) -> None:
        try:
            allocation_id, slots = landing.allocate(namespace_id, layout, keys, generation)
        except KVStoreError as exc:  # no room, another layout or generation: these pages come whole at the Push
            logger.info("no landing for %d pages' layers: %s", len(keys), exc)
            return
        for key, slot in slots:
            if slot is not None:
                self._slots[key] = _Slot(allocation_id, landing)

    def commit(self, namespace_id: bytes, keys: list[bytes], checksums: list[int], page_bytes: int, holder: str) -> int:
        """At the Push of ``keys`` (stored at ``holder`` now, with ``checksums`` for a prefix of
        them): commits the slots of those whose every byte landed; every allocation they touch
        is ended (its other slots given back). Returns how many pages it committed."""
        sums = dict(zip(keys, checksums))
        with self._lock:
            whole: dict[bytes, tuple[Landing, list[bytes]]] = {}
            for key in keys:
                if (slot := self._slots.get(key)) is not None:
                    ready = whole.setdefault(slot.allocation_id, (slot.landing, []))[1]
                    if slot.landed == page_bytes and key in sums:
                        ready.append(key)
            committed = 0
            for allocation_id, (landing, ready) in whole.items():
                committed += self._commit(namespace_id, allocation_id, landing, ready, [sums[k] for k in ready], holder)
                self._drop(allocation_id)
            return committed

    def _commit(self, namespace_id: bytes, allocation_id: bytes, landing: Landing, keys: list[bytes], checksums: list[int],
                holder: str) -> int:
        if not keys:
            self.core.abort(allocation_id)
            return 0
        try:
            landing.commit(allocation_id, keys, checksums)
        except KVStoreError as exc:  # expired, a generation moved on: those pages come whole (or not at all)
            logger.info("layers of %d handed-off pages not committed: %s", len(keys), exc)
            self.core.abort(allocation_id)
            return 0
        self.core.reads.unchecked.landed(namespace_id, keys, holder)  # a reader that finds one damaged asks the holder
        self.core.metrics.handoff_layer_pages.inc(len(keys))
        return len(keys)

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
