"""A damaged SSD index entry costs its own page at a restart, not its slab's other pages."""

from __future__ import annotations

import random
from pathlib import Path

from support.ssd_pages import set_entry_offset, store_pages

from kvstore.config import SsdTierConfig
from kvstore.page import LayoutDesc
from kvstore.tiers.ssd import SsdTier

LAYOUT = LayoutDesc(2, 2, 2, 64, "float16", 16)


def test_an_entry_naming_another_pages_slot_costs_itself_not_that_page_nor_the_slab(tmp_path: Path) -> None:
    """Bug (found while building the chaos model's ssd_flip fault): at start the slot allocator
    refused a whole slab when two of its index entries named one slot (or sizes were mixed),
    so one flipped offset byte in one entry dropped every page of its slab (up to a slab of 16 MiB
    of acknowledged durable pages; here all 8). Then (ad15835) it cost both entries of the shared
    slot, page 6 too, undamaged; now the slot's header on disk names page 6: only page 7 is lost."""
    config = SsdTierConfig(tmp_path, capacity_bytes=64 << 20, dwpd=0)
    tier = SsdTier(config)
    payloads, slots = store_pages(tier, LAYOUT, 8, random.Random(3))
    tier.close()
    keys = list(payloads)
    set_entry_offset(tmp_path, keys[7], slots[keys[6]])  # page 7's entry names page 6's slot
    tier = SsdTier(config)
    try:
        assert sorted(key for key, *_ in tier.recover()) == keys[:7]
        for key in keys[:7]:
            into = bytearray(LAYOUT.page_bytes)
            assert tier.read_into([(key, memoryview(into))]).num_read == 1 and into == payloads[key]
    finally:
        tier.close()
