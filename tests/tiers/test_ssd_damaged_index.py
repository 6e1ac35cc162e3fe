"""A damaged SSD index entry costs its own page at a restart, not its slab's other pages."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import lmdb

from kvstore.config import SsdTierConfig
from kvstore.page import LayoutDesc, PageHeader, checksum
from kvstore.tiers.ssd import INDEX_DIR, SsdTier

LAYOUT = LayoutDesc(2, 2, 2, 64, "float16", 16)


def test_an_entry_naming_another_pages_slot_costs_itself_not_that_page_nor_the_slab(tmp_path: Path) -> None:
    """Bug (found while building the chaos model's ssd_flip fault): at start the slot allocator
    refused a whole slab when two of its index entries named one slot (or sizes were mixed),
    so one flipped offset byte in one entry dropped every page of its slab (up to a slab of 16 MiB
    of acknowledged durable pages; here all 8). Then (ad15835) it cost both entries of the shared
    slot, page 6 too, undamaged; now the slot's header on disk names page 6: only page 7 is lost."""
    config = SsdTierConfig(tmp_path, capacity_bytes=64 << 20, dwpd=0)
    tier = SsdTier(config)
    rng = random.Random(3)
    payloads, slots = {}, {}
    for i in range(8):
        key, payload = i.to_bytes(16, "big"), rng.randbytes(LAYOUT.page_bytes)
        slot = tier.reserve(len(payload))
        assert slot is not None
        header = PageHeader(b"n" * 16, key, LAYOUT, len(payload), checksum(payload), generation=1)
        tier.write([(slot, header, memoryview(payload))])
        tier.commit([(slot, header)])
        payloads[key], slots[key] = payload, slot
    tier.close()
    keys = list(payloads)
    env = lmdb.open(str(tmp_path / INDEX_DIR), subdir=True, max_dbs=4)
    with env.begin(write=True, db=env.open_db(b"index")) as txn:  # page 7's entry names page 6's slot
        value = bytearray(txn.get(keys[7]))
        struct.pack_into("<Q", value, 0, slots[keys[6]])
        txn.put(keys[7], bytes(value))
    env.close()
    tier = SsdTier(config)
    try:
        assert sorted(key for key, *_ in tier.recover()) == keys[:7]
        for key in keys[:7]:
            into = bytearray(LAYOUT.page_bytes)
            assert tier.read_into([(key, memoryview(into))]).num_read == 1 and into == payloads[key]
    finally:
        tier.close()
