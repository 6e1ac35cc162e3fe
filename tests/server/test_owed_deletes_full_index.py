"""An invalidation frees a full SSD index. Its owed SSD deletes go in one index transaction per
tier part (test_owed_removal_batches.py); with the index's map full, that one transaction is
refused whole (an LMDB transaction copies every leaf page it touches before it frees any), and a
failed owed removal is never retried: every SSD copy of the namespace stayed on the device and
the tier refused every write until a restart (found by a review of that change, 2026-12-08; one
transaction a page went through). A batch refused for a full index is now deleted a key at a time.

Real Placement, real SSD tier (data file, LMDB index) with a small index map; no mock."""

from __future__ import annotations

import dataclasses
import hashlib

from support.servers import make_config

from kvstore.errors import KVStoreError
from kvstore.page import LayoutDesc, checksum
from kvstore.server.placement import Placement

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages
NS = b"owed-namespace!!"
MAP_BYTES = 128 << 10  # --lmdb-map-size 128KiB: the index fills (~150 entries) long before the 64 MiB device


def _payload(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (LAYOUT.page_bytes // 64)


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]


def _put_durable(core: Placement, keys: list[bytes]) -> int:
    alloc, slots = core.allocate(NS, LAYOUT, keys)
    for key, _ in slots:
        core.slot_view(alloc, key)[:] = _payload(key)
    return core.commit(alloc, keys, [checksum(_payload(k)) for k in keys], durable=True)


def test_an_invalidation_frees_a_full_ssd_index(tmp_path) -> None:
    config = make_config(tmp_path, host_bytes=64 << 20, ssd_bytes=64 << 20)
    config = dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, index_map_bytes=MAP_BYTES))
    core = Placement(config)
    try:
        ssd = core.residence.tiers[1]
        batch = 0
        while True:  # durable pages until the index is full (the tier refuses the write)
            try:
                _put_durable(core, _keys(f"full{batch}", 8))
            except KVStoreError:
                break
            batch += 1
            assert batch < 200, "the ssd index never filled"
        on_ssd = ssd.usage().num_pages
        assert on_ssd > 64, on_ssd

        core.invalidate(NS, [])  # every page of the namespace goes, its SSD copies as owed removals
        left = ssd.usage().num_pages
        assert left == 0, (f"{left} of the {on_ssd} invalidated pages are still on the SSD (never retried): their one "
                           "delete transaction was refused by the full index")

        fresh = _keys("after", 8)  # the device has room again
        assert _put_durable(core, fresh) == len(fresh)
        assert all("ssd" in core.where(k) for k in fresh), [core.where(k) for k in fresh]
    finally:
        core.close()
