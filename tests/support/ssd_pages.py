"""Pages written straight into an SsdTier (no server) and index entries edited on disk: the setup of the
SSD recovery and damage tests."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from pathlib import Path

import lmdb

from kvstore.page import LayoutDesc, PageHeader, checksum
from kvstore.tiers.ssd import INDEX_DIR, SsdTier


def store_page(tier: SsdTier, key: bytes, layout: LayoutDesc, payload: bytes) -> int:
    """Stores one page of namespace b"n" * 16, generation 1, as the server would; returns its slot."""
    slot = tier.reserve(len(payload))
    assert slot is not None
    header = PageHeader(b"n" * 16, key, layout, len(payload), checksum(payload), generation=1)
    tier.write([(slot, header, memoryview(payload))])
    tier.commit([(slot, header)])
    return slot


def store_pages(tier: SsdTier, layout: LayoutDesc, count: int, rng: random.Random) -> tuple[dict[bytes, bytes], dict[bytes, int]]:
    """``count`` random pages keyed 0, 1, ... (16 bytes, big-endian): (key -> payload, key -> slot)."""
    payloads, slots = {}, {}
    for i in range(count):
        key, payload = i.to_bytes(16, "big"), rng.randbytes(layout.page_bytes)
        slots[key] = store_page(tier, key, layout, payload)
        payloads[key] = payload
    return payloads, slots


def edit_index_entry(ssd_dir: Path, key: bytes, edit: Callable[[bytearray], None]) -> None:
    """Rewrites ``key``'s SSD index entry with ``edit`` (its tier is closed, its server stopped)."""
    env = lmdb.open(str(ssd_dir / INDEX_DIR), subdir=True, max_dbs=4)
    try:
        with env.begin(write=True, db=env.open_db(b"index", create=False)) as txn:
            value = bytearray(txn.get(key))
            edit(value)
            txn.put(key, bytes(value))
    finally:
        env.close()


def set_entry_offset(ssd_dir: Path, key: bytes, offset: int) -> None:
    """Makes ``key``'s index entry name another slot (its first field, u64)."""
    edit_index_entry(ssd_dir, key, lambda value: struct.pack_into("<Q", value, 0, offset))
