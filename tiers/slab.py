"""Slab allocation of fixed-size page slots inside one arena (or one file).

The arena is cut into equal slabs; a slab serves one slot size (page bytes rounded up to
4 KiB, so slots stay aligned for O_DIRECT and for the CPU). A slab whose slots are all free
goes back to the pool, so a size that is no longer used gives its space to others.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class SlabAllocator:
    """Offsets of free slots. Not thread-safe: the owner serialises calls."""

    def __init__(self, base: int, capacity: int, slab_bytes: int) -> None:
        self.base = base
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity // slab_bytes
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._slab_class: dict[int, int] = {}          # slab index -> slot bytes
        self._slab_free: dict[int, dict[int, None]] = {}  # slab index -> free slot offsets (an ordered set: LIFO, O(1) lookup)
        self._partial: dict[int, set[int]] = {}        # slot bytes -> slabs with a free slot
        self.used_bytes = 0

    @property
    def capacity(self) -> int:
        return self.num_slabs * self.slab_bytes

    def fits(self, nbytes: int) -> bool:
        return 0 < round_up(nbytes) <= self.slab_bytes

    def alloc(self, nbytes: int) -> int | None:
        """A free slot for ``nbytes``, or None when no slot and no slab is free."""
        size = round_up(nbytes)
        partial = self._partial.setdefault(size, set())
        if not partial:
            if not self._free_slabs:
                return None
            slab = self._free_slabs.pop()
            start = self.base + slab * self.slab_bytes
            count = self.slab_bytes // size
            self._slab_class[slab] = size
            self._slab_free[slab] = dict.fromkeys(start + i * size for i in range(count - 1, -1, -1))
            partial.add(slab)
        slab = next(iter(partial))
        slots = self._slab_free[slab]
        offset, _ = slots.popitem()
        if not slots:
            partial.discard(slab)
        self.used_bytes += size
        return offset

    def free(self, offset: int) -> None:
        """Gives a slot back. An offset ``alloc`` could never have returned (no slab of it in
        use, not on a slot boundary, or a slot running past its slab's end) is refused and
        logged: on a free list it would be handed out over the bytes of other slots. So is a
        slot already free: twice on the list, it would be handed to two pages at once."""
        slab, within = divmod(offset - self.base, self.slab_bytes)
        size = self._slab_class.get(slab)
        if size is None or within % size or within // size >= self.slab_bytes // size:
            logger.error("slab allocator: refusing to free offset %d, not a slot in use (slab %d, %s-byte slots)",
                         offset, slab, size)
            return
        slots = self._slab_free[slab]
        if offset in slots:
            logger.error("slab allocator: refusing to free offset %d twice (slab %d, %s-byte slots)", offset, slab, size)
            return
        slots[offset] = None
        self.used_bytes -= size
        if len(slots) == self.slab_bytes // size:
            del self._slab_class[slab], self._slab_free[slab]
            self._partial[size].discard(slab)
            self._free_slabs.append(slab)
        else:
            self._partial[size].add(slab)

    def slot_bytes(self, offset: int) -> int:
        return self._slab_class[(offset - self.base) // self.slab_bytes]

    def claim_many(self, slots: list[tuple[int, int]], vouch: Callable[[int], bool] | None = None) -> list[bool]:
        """Marks many known slots used at once (start-up): O(slots) overall instead of a
        list search per slot. Returns per slot whether it could be claimed.

        A slot ``alloc`` never hands out (outside every slab, off its size's slot boundaries,
        or running past its slab's end into the next) is refused. Where a slab's slots
        conflict, ``vouch(i)`` (the SSD tier reads slot i's header) says whether slot i is what
        it claims to be, asked of every slot of a slab of mixed sizes, else of the slots named
        twice; those it refuses are dropped. A clean start asks nothing. What still
        conflicts costs itself: the slab's size is its slots' most common one, a shared slot
        is refused. Claimed slots never share a byte."""
        by_slab: dict[int, list[tuple[int, int, int]]] = {}
        ok = [False] * len(slots)
        for i, (offset, nbytes) in enumerate(slots):
            size = round_up(nbytes)
            slab, within = divmod(offset - self.base, self.slab_bytes)
            if 0 <= slab < self.num_slabs and within % size == 0 and within + size <= self.slab_bytes:
                by_slab.setdefault(slab, []).append((i, offset, size))
        free_slabs = set(self._free_slabs)
        for slab, found in by_slab.items():
            if slab not in free_slabs:
                continue  # already in use
            if len({it[2] for it in found}) == 1 and len({it[1] for it in found}) == len(found):
                items = found  # the common case, a clean start: nothing to read
            else:
                if vouch is not None:  # asked of every slot when sizes are mixed, else of the shared ones
                    mixed, named = len({it[2] for it in found}) > 1, Counter(it[1] for it in found)
                    found = [it for it in found if not (mixed or named[it[1]] > 1) or vouch(it[0])]
                sizes = Counter(it[2] for it in found)
                size = max(sizes, key=lambda s: (sizes[s], -s), default=0)
                offsets = Counter(offset for _, offset, nbytes in found if nbytes == size)
                items = [it for it in found if it[2] == size and offsets[it[1]] == 1]
            if not items:
                continue
            size = items[0][2]
            start = self.base + slab * self.slab_bytes
            used = {offset for _, offset, _ in items}
            free_slabs.discard(slab)
            self._slab_class[slab] = size
            count = self.slab_bytes // size
            self._slab_free[slab] = dict.fromkeys(start + j * size for j in range(count - 1, -1, -1) if start + j * size not in used)
            if self._slab_free[slab]:
                self._partial.setdefault(size, set()).add(slab)
            else:
                self._partial.setdefault(size, set())
            self.used_bytes += size * len(items)
            for i, _, _ in items:
                ok[i] = True
        self._free_slabs = sorted(free_slabs, reverse=True)
        return ok
