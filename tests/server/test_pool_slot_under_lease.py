"""A page's slot in an hbm pool that a live lease names (``Promoter.placed`` hands its offset to
the engine, which reads the pool directly) is not given to another page until the lease goes,
however the pool copy leaves: quarantined by a demotion's read while a reader leased the page
meanwhile, quarantined by another reader's read-up, or removed (and written and promoted again).
Its slot waits for the last pin, as a landing slot does (``Residence.keep_detached``,
tests/server/test_quarantine_under_lease.py). Bug pinned: each of these freed the pool slot at
once (a removal's ``delete_lower_first`` deleted it; with that mended, the promotion again freed
the removed copy's slot at its commit) and the next promotion took it while the lease still named
it. The pool is emulated in host memory (``--hbm-device cpu``), in-process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from support.core_pages import CorePages, page_keys
from support.servers import make_config

from kvstore.config import HbmTierConfig
from kvstore.server.placement import Placement
from kvstore.server.placement.reads import AcquiredPage

POOL_PAGES = 32  # a 1 MiB pool of 32 KiB pages (support.core_pages.LAYOUT)


def _core(tmp: Path) -> Placement:
    config = dataclasses.replace(make_config(tmp, host_bytes=8 << 20, ssd_bytes=None), tiers=("hbm", "host"),
                                 hbm=HbmTierConfig(capacity_bytes=1 << 20, slab_bytes=1 << 20, device="cpu"))
    return Placement(config)


def _offset(core: Placement, pages: list[AcquiredPage]) -> int | None:
    return core.promoter.placed(pages)[1][0]


def _scribble(core: Placement, key: bytes) -> None:
    """An engine writes into its pool (it maps it read-write) over ``key``'s copy."""
    pool = core.promoter.tier.part_of(key)
    pool.device_view(pool.find(key)[0], 1).bitwise_xor_(0xFF)


def _promoted_elsewhere(core: Placement, pages: CorePages, name: str, offset: int) -> None:
    """Another page promoted now does not take the slot at ``offset`` (its lease is let go)."""
    other = page_keys(name, 1)
    assert pages.put(core, other) == 1
    lease, got = core.acquire(pages.ns, other, 0, device=True)
    assert _offset(core, got) is not None
    assert _offset(core, got) != offset, "the pool slot a live lease names was handed to another page"
    core.release(lease)


def test_a_demotion_that_finds_a_page_damaged_keeps_its_slot_for_a_lease_taken_during_the_copy(tmp_path) -> None:
    core = _core(tmp_path)
    try:
        pages = CorePages(b"pool-demotion")
        held = page_keys("held-in-hbm", POOL_PAGES)
        assert pages.put(core, held) == POOL_PAGES
        core.release(core.acquire(pages.ns, held, 0, device=True)[0])  # the pool is full
        core.remove(pages.ns, held, tier="host")  # held in hbm only: a victim is demoted, not dropped
        pool = core.promoter.tier.part_of(held[0])
        read, reader = pool.read_into, {}

        def demotion_read(items, verify=True):  # type: ignore[no-untyped-def]
            pool.read_into = read
            key = items[0][0]  # the demoter's copy, the core's lock let go: a reader leases the page meanwhile
            lease, got = core.acquire(pages.ns, [key], 0, device=True)
            reader.update(lease=lease, key=key, offset=_offset(core, got))
            _scribble(core, key)  # and the demotion's read then finds it damaged
            return read(items, verify)

        pool.read_into = demotion_read
        after = page_keys("promoted-after", 1)
        assert pages.put(core, after) == 1
        lease, got = core.acquire(pages.ns, after, 0, device=True)  # needs room: demotes a victim
        assert reader and reader["offset"] is not None and reader["key"] in [q.key for q in core.quarantined()]
        assert _offset(core, got) not in (None, reader["offset"]), "the pool slot a live lease names was handed to another page"
        _promoted_elsewhere(core, pages, "promoted-next", reader["offset"])
        core.release(lease)
        core.release(reader["lease"])
        assert core.view().idle
    finally:
        core.close()


def test_a_read_up_that_finds_a_pool_page_damaged_keeps_its_slot_for_the_lease_that_names_it(tmp_path) -> None:
    core = _core(tmp_path)
    try:
        pages = CorePages(b"pool-read-up")
        keys = page_keys("named", 1)
        assert pages.put(core, keys) == 1
        lease, got = core.acquire(pages.ns, keys, 0, device=True)
        offset = _offset(core, got)
        assert offset is not None
        core.remove(pages.ns, keys, tier="host")  # the lease keeps its arena slot; the pool copy is the live one
        _scribble(core, keys[0])
        second, none = core.acquire(pages.ns, keys, 0)  # read up from the pool: damaged, quarantined there
        assert none == [] and keys[0] in [q.key for q in core.quarantined()]
        core.release(second)
        _promoted_elsewhere(core, pages, "other", offset)
        core.release(lease)
        assert core.view().idle
    finally:
        core.close()


def test_a_pool_page_removed_and_promoted_again_keeps_its_old_slot_for_the_lease_that_names_it(tmp_path) -> None:
    core = _core(tmp_path)
    try:
        pages = CorePages(b"pool-removed")
        keys = page_keys("removed", 1)
        assert pages.put(core, keys) == 1
        lease, got = core.acquire(pages.ns, keys, 0, device=True)
        offset = _offset(core, got)
        assert offset is not None
        assert core.remove(pages.ns, keys) == 1  # every copy; the lease still names both slots
        assert pages.put(core, keys) == 1  # written again
        again, got = core.acquire(pages.ns, keys, 0, device=True)  # and promoted again, into another slot
        assert _offset(core, got) not in (None, offset), "the pool slot a live lease names was handed out again"
        _promoted_elsewhere(core, pages, "other", offset)
        core.release(again)
        core.release(lease)
        assert core.view().idle
    finally:
        core.close()
