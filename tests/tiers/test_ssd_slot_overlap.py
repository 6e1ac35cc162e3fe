"""A damaged SSD index entry must never make two recovered pages share bytes on disk.

claim_many checks that an entry's offset lies in a slab and is a multiple of its size from the
slab's start, but not that the slot ends inside the slab: when the slab is no multiple of the
slot size (16 MiB slabs, 12 KiB slots: 1365 slots and 4 KiB over), an entry naming slot 1365,
one the allocator never hands out, is claimed, and its extent runs 8 KiB into the next slab,
over the first slot there, which another page holds."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from support.ssd_pages import set_entry_offset, store_page

from kvstore.config import SsdTierConfig
from kvstore.page import LayoutDesc
from kvstore.tiers.slab import SlabAllocator
from kvstore.tiers.ssd import SsdTier

BIG = LayoutDesc(2, 1, 1, 64, "float16", 32)    # 8 KiB payload: 12 KiB slots (header 4 KiB)
SMALL = LayoutDesc(1, 1, 1, 64, "float16", 32)  # 4 KiB payload: 8 KiB slots, in a slab of their own


def _extents(allocator: SlabAllocator, claimed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return sorted((offset, offset + size) for offset, size in claimed)


def test_claim_many_never_accepts_a_slot_that_runs_past_its_slab() -> None:
    """Unit form: slabs of 20 KiB, slots of 8 KiB: a slab holds 2 (16 KiB) and 4 KiB over. An
    entry at 16 KiB (slot 2 of slab 0, which alloc never gives) spans 16-24 KiB, over slab 1's
    first slot (20-28 KiB). Both are claimed."""
    allocator = SlabAllocator(0, 2 * 20480, 20480)
    slots = [(16384, 8192), (20480, 8192)]
    ok = allocator.claim_many(slots)
    claimed = [slot for slot, good in zip(slots, ok) if good]
    ends = _extents(allocator, claimed)
    overlaps = [(a, b) for a, b in itertools.pairwise(ends) if a[1] > b[0]]
    assert not overlaps, f"claimed slots share bytes: {overlaps} (claimed {claimed})"


def test_free_refuses_an_offset_alloc_never_hands_out() -> None:
    """The backstop: a slot past its slab's end (or off its size's boundaries) freed into the slab
    would be handed out over the next slab's first slot, and would let the slab go back to the
    pool with a live page in it."""
    allocator = SlabAllocator(0, 2 * 20480, 20480)
    assert allocator.alloc(8192) == 0  # a live page in slot 0 of slab 0
    for phantom in (16384, 4096, 3 * 20480):  # past the slab's end, off a boundary, past the arena
        allocator.free(phantom)
    handed = [allocator.alloc(8192) for _ in range(4)]
    assert sorted(h for h in handed[:3] if h is not None) == [8192, 20480, 28672] and handed[3] is None, handed
    assert allocator.used_bytes == 4 * 8192


def test_a_slot_freed_twice_is_handed_out_once() -> None:
    """A second free of a slot already free is refused: on the free list twice, the slot would be
    handed to two pages at once (each write over the other's bytes), and the slab would count
    itself empty, and go back to the pool, while a page still lives in it."""
    allocator = SlabAllocator(0, 2 * 20480, 20480)
    first, second = allocator.alloc(8192), allocator.alloc(8192)
    allocator.free(first)
    allocator.free(first)  # the bug being guarded against: a caller frees the same slot again
    handed = [allocator.alloc(8192) for _ in range(3)]
    live = [second, *(h for h in handed if h is not None)]
    assert len(live) == len(set(live)), f"a slot was handed out twice: {live}"
    assert allocator.used_bytes == 8192 * len(live), allocator.used_bytes


def _page(tier: SsdTier, key: bytes, layout: LayoutDesc, rng: random.Random) -> tuple[int, bytes]:
    payload = rng.randbytes(layout.page_bytes)
    return store_page(tier, key, layout, payload), payload


def test_a_damaged_offset_never_lets_a_later_write_land_on_another_recovered_page(tmp_path: Path) -> None:
    """End to end on a real SsdTier (64 MiB, 16 MiB slabs): 4 big pages in slab 0, 1 small page
    in slab 1 (offset 16 MiB). Big page 0's index entry is damaged to name slot 1365 of slab 0
    (offset 16 MiB - 4 KiB). At the restart both it and the small page are recovered although
    their extents overlap. The damaged page fails its read and is quarantined (its slot freed
    into slab 0); the next big page written gets that slot, and its bytes land on the small
    page, an acknowledged durable page that was whole at the restart."""
    config = SsdTierConfig(tmp_path, capacity_bytes=64 << 20, dwpd=0)
    tier = SsdTier(config)
    rng = random.Random(5)
    big_keys = [bytes([0xB0, i]) * 8 for i in range(4)]
    slots = {}
    for key in big_keys:
        slots[key], _ = _page(tier, key, BIG, rng)
    small_key = b"\x5a" * 16
    small_slot, small_payload = _page(tier, small_key, SMALL, rng)
    slab = tier._allocator.slab_bytes
    assert slab == 16 << 20 and small_slot == slab, (slab, small_slot)
    tier.close()

    phantom = (slab // 12288) * 12288  # slot 1365 of slab 0: 16 MiB - 4 KiB .. 16 MiB + 8 KiB
    set_entry_offset(tmp_path, big_keys[0], phantom)

    tier = SsdTier(config)
    try:
        recovered = {key for key, *_ in tier.recover()}
        assert small_key in recovered
        into = bytearray(SMALL.page_bytes)
        assert tier.read_into([(small_key, memoryview(into))]).num_read == 1 and into == small_payload
        # The damaged page fails its read; the server quarantines it (its slot goes back).
        if big_keys[0] in recovered:
            bad = bytearray(BIG.page_bytes)
            assert tier.read_into([(big_keys[0], memoryview(bad))]).num_read == 0
            tier.quarantine(big_keys[0], "failed its read")
        # Later writes of big pages (the tier's ordinary use).
        for i in range(4):
            _page(tier, bytes([0xC0, i]) * 8, BIG, rng)
        into = bytearray(SMALL.page_bytes)
        result = tier.read_into([(small_key, memoryview(into))])
        assert result.num_read == 1 and into == small_payload, (
            f"the small page, whole at the restart, was overwritten by a later write: {result}")
    finally:
        tier.close()


HUGE = LayoutDesc(2, 2, 2, 64, "float16", 16)  # 16 KiB payload: 20 KiB slots, a third slab


def test_a_damaged_entry_of_another_size_never_costs_a_page_whose_slot_it_does_not_name(tmp_path: Path) -> None:
    """ad15835 says a damaged entry costs itself and the entry whose slot it names. Slab 1 holds
    one big page (12 KiB slot at 16 MiB). A small page's entry (8 KiB slots, slab 0) is damaged
    to name 16 MiB + 16 KiB: a slot of slab 1 that overlaps nothing. The slab's sizes tie 1:1
    and the tie goes to the smaller size, so the big page, undamaged and overlapped by nothing,
    is dropped at the restart while the damaged entry is claimed."""
    config = SsdTierConfig(tmp_path, capacity_bytes=64 << 20, dwpd=0)
    tier = SsdTier(config)
    rng = random.Random(7)
    small_keys = [bytes([0x50, i]) * 8 for i in range(4)]
    for key in small_keys:
        _page(tier, key, SMALL, rng)
    big_key = b"\xb1" * 16
    big_slot, big_payload = _page(tier, big_key, BIG, rng)
    _page(tier, b"\xee" * 16, HUGE, rng)  # slab 2: the data file reaches past slab 1
    slab = tier._allocator.slab_bytes
    assert big_slot == slab, big_slot
    tier.close()

    set_entry_offset(tmp_path, small_keys[3], slab + 16384)

    tier = SsdTier(config)
    try:
        recovered = {key for key, *_ in tier.recover()}
        assert big_key in recovered, "the big page, named by no damaged entry, was dropped at the restart"
        into = bytearray(BIG.page_bytes)
        assert tier.read_into([(big_key, memoryview(into))]).num_read == 1 and into == big_payload
    finally:
        tier.close()
