"""A demoter round in flight (its pages pinned as moving, their write not done) while a put
goes on, with an SSD index that is full: every write-down fails, so what an eviction takes is
lost from the node. The put keeps its head: its allocations take its tail past the round's
pages, not the pages before them.

Bug pinned: the chain walk ended at a page being moved down, so while a round was in flight
every allocation took the page right before the round's, and the put lost its chain from there
back to its head (a fresh-clone CI run under load: the RAM put of
test_metadata_full's full-index test answered 0 pages)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from support.core_pages import CorePages, in_host, page_keys, payload
from support.servers import make_config

from kvstore.errors import TierFull
from kvstore.page import checksum
from kvstore.server.placement import Placement

NS = b"round-in-flight!"
PAGES = CorePages(NS)


def _fill_index(core: Placement) -> None:
    """Durable puts until the SSD index refuses one: every later write-down fails."""
    for n in range(1000):
        keys = page_keys(f"durable{n}", 8)
        alloc = PAGES.allocate(core, keys)
        try:
            core.commit(alloc, keys, [checksum(payload(k)) for k in keys], durable=True)
        except TierFull:
            return
    raise AssertionError("a 64 KiB index must fill up")


@pytest.mark.parametrize("batch_open", [False, True], ids=["between-batches", "batch-open"])
def test_a_round_in_flight_leaves_the_put_its_head(tmp_path, batch_open: bool) -> None:
    """The round starts once RAM holds the put's first 128 pages: between two batches (it names
    the put's tail; the next allocation takes the pages before it, as tail first says, and the
    round's pages, kept in RAM when their write fails, are orphans then, which go first), or
    while a batch is open (it names the pages the batch leans on, and the batch commits after
    them: the put's next allocations take that tail, walking through the round's pages)."""
    config = make_config(tmp_path, host_bytes=4 << 20)  # 128 pages
    assert config.ssd is not None
    core = Placement(dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, index_map_bytes=64 << 10)))
    try:
        _fill_index(core)
        put = page_keys("put", 256)
        entered, go = threading.Event(), threading.Event()
        write_down = core.moves.write_down

        def held_in_round(*args, **kwargs):  # the round's write waits until the put has gone on
            if threading.current_thread().name == "round":
                entered.set()
                assert go.wait(60)
            return write_down(*args, **kwargs)

        core.moves.write_down = held_in_round  # type: ignore[method-assign]
        round_thread = threading.Thread(target=core.demote_one, name="round")
        parent = None

        def start_round() -> None:
            round_thread.start()
            assert entered.wait(60), "the round wrote nothing down"
            assert any(core.leases.moving(k) for k in put), "the round pinned none of the put's pages"

        for start in range(0, len(put), 8):
            batch = put[start:start + 8]
            alloc = PAGES.allocate(core, batch, parent=parent)
            if start == 120 and batch_open:
                start_round()
            PAGES.commit(core, alloc, batch)
            parent = batch[-1]
            if start == 120 and not batch_open:
                start_round()
        go.set()
        round_thread.join(60)
        assert not round_thread.is_alive()
        head = in_host(core, put).index(False)  # the round named about 13 pages (to the low watermark)
        assert head >= 96, f"the put kept {head} of its leading pages in RAM, the round started at 128"
        assert PAGES.found(core, put) == head
        assert core.view().idle, core.view()
    finally:
        go.set()
        core.close()


def test_a_tenants_room_at_its_quota_walks_a_round_as_every_eviction(tmp_path) -> None:
    """A tenant's room at its host quota (Placement.evict_own, NotAmong) sees a round's pages as
    being moved, as every other eviction does: with the round holding the tail of the tenant's only
    chain, the room is made with the pages before it (tail first), not refused while the round is
    in flight (it counted the round's pages as pinned, keeping the whole chain)."""
    core = Placement(make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=None))
    try:
        put = page_keys("put", 16)
        assert PAGES.put(core, put) == 16
        core.leases.pin(put[8:], move=True)  # a round named the chain's tail; its write is in flight
        try:
            assert core.evict_own(frozenset([NS]), 12 * core.config.host.capacity_bytes // 128)
        finally:
            core.leases.unpin(put[8:], move=True)
        assert in_host(core, put) == [True] * 4 + [False] * 4 + [True] * 8
        assert core.view().idle, core.view()
    finally:
        core.close()
