"""An open allocation keeps the page it names as its parent: the server, not the order in
which a client sends its commits, keeps a put's head while its later batches are written.

Bug pinned: a batch allocated before the batch it extends was committed held nothing;
once that earlier batch was committed, other allocations could evict it (the oldest chain)
while the later batch was still being written, and the later batch's commit then stored
nothing findable (lookups are prefix lookups). The client sent its commits in order as a
workaround (client/transport/shm_pipeline.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from support.core_pages import LAYOUT, CorePages, in_host, page_keys, payload
from support.servers import make_config

from kvstore.errors import TierFull
from kvstore.server.placement import Placement

NS = b"parent-namespace"
PAGES = CorePages(NS)
_keys, _payload, _in_host = page_keys, payload, in_host
_allocate, _commit, _found = PAGES.allocate, PAGES.commit, PAGES.found


@pytest.fixture
def core(tmp_path):
    core = Placement(make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=None, allocation_ttl_ms=300))
    yield core
    core.close()


def test_an_open_allocation_keeps_its_committed_parent(core: Placement) -> None:
    """Batch 2 is allocated before batch 1 commits; other puts then fill the tier while
    batch 2 is written: batch 1 (the put's head) stays, and batch 2's commit counts."""
    head, tail = _keys("head", 8), _keys("tail", 8)
    first = _allocate(core, head)
    second = _allocate(core, tail, parent=head[-1])
    assert _commit(core, first, head) == 8
    for n in range(30):  # 240 pages through a 128-page tier, while batch 2 is open
        others = _keys(f"other{n}", 8)
        assert _commit(core, _allocate(core, others), others) == 8
    assert _commit(core, second, tail) == 8, "the put's head was evicted while its next batch was open"
    assert _found(core, head + tail) == 16
    assert core.view().idle, core.view()


def test_an_aborted_expired_or_refused_allocation_leaves_no_pin(core: Placement) -> None:
    head = _keys("head", 4)
    assert _commit(core, _allocate(core, head), head) == 4
    core.abort(_allocate(core, _keys("aborted", 4), parent=head[-1]))
    assert core.view().idle, core.view()
    _allocate(core, _keys("expired", 4), parent=head[-1])
    time.sleep(0.4)
    core.stats()  # reaps what expired
    assert core.view().idle, core.view()
    everything = _allocate(core, _keys("fill", 124))  # every slot reserved: the next allocation finds no room
    with pytest.raises(TierFull):
        core.allocate(NS, LAYOUT, _keys("refused", 2), parent=head[-1])
    core.abort(everything)
    assert core.view().idle, core.view()
    assert _found(core, head) == 4


@pytest.fixture
def core_ssd(tmp_path):
    core = Placement(make_config(tmp_path, host_bytes=4 << 20, allocation_ttl_ms=30_000))
    yield core
    core.close()


def _fill_reused(core: Placement) -> list[bytes]:
    """120 of the 128 pages, in prefixes each read back (reused): 96 protected, 24 in probation."""
    others: list[bytes] = []
    for n in range(15):
        keys = _keys(f"other{n}", 8)
        assert _commit(core, _allocate(core, keys), keys) == 8
        assert _found(core, keys) == 8
        others += keys
    return others


def _put_in_batches(core: Placement, put: list[bytes], each: Callable[[int], None] = lambda start: None) -> None:
    parent = None
    for start in range(0, len(put), 8):
        batch = put[start:start + 8]
        alloc = _allocate(core, batch, parent=parent)
        each(start)
        assert _commit(core, alloc, batch) == 8
        parent = batch[-1]


def test_with_a_tier_below_a_put_keeps_its_head(core_ssd: Placement) -> None:
    """With an SSD below, an open allocation does not pin its parent (a put may outgrow RAM);
    it leans on it: the chain a put extends goes after the other probation pages, so the put
    keeps its head, and the put's later pages go down instead. (Failed a fresh-clone run under
    load: the put's pages were the only probation pages, each batch's allocation evicted the
    batch before it, the next batch then committed as orphans, which go first: the put
    streamed through RAM head and all.)"""
    core = core_ssd
    _fill_reused(core)
    put = _keys("put", 64)

    def head_kept(start: int) -> None:
        held = _in_host(core, put[:start])
        head = held.index(False) if False in held else start
        assert head >= min(start, 16), f"batch {start // 8}'s allocation evicted the put's head: {head} of {start} pages left"

    _put_in_batches(core, put, head_kept)
    assert all(core.residence.stored(k) for k in put)
    assert _found(core, put) == 64


def test_with_a_tier_below_a_put_larger_than_ram_is_stored_whole_and_leaves_reused_pages(core_ssd: Placement) -> None:
    """The other half of the rule: a put being written takes reused (protected) pages down to
    half their share of the resident pages (eviction.LEANED_FLOOR), then its own later pages
    (DESIGN §6): a one-shot put three times the tier is stored and found whole, keeps its head,
    and leaves at least 40 of the 96 reused pages in RAM (48: the floor is 0.4 of the resident
    pages, 120 while a batch's 8 slots are reserved). On f53df30's order, which kept a put's
    chain over every unannounced page, it pushed them all out."""
    core = core_ssd
    others, put = _fill_reused(core), _keys("huge", 400)
    _put_in_batches(core, put)
    assert sum(_in_host(core, others)) >= 40, "a one-shot put pushed reused pages out of RAM"
    assert _in_host(core, put[:16]) == [True] * 16, "the put gave up its head"
    assert all(core.residence.stored(k) for k in put)
    assert _found(core, put[:100]) == 100
    assert core.view().idle, core.view()


def test_a_demoter_round_while_a_put_is_open_leaves_its_head(core_ssd: Placement) -> None:
    """The failing interleaving itself: the reused pages are all protected (the probation ones
    removed), the put's pages are the only probation pages, and a demoter round (to the low
    watermark) runs while each of its batches is open. On 4275cb1 the rounds wrote the put's
    committed pages down, head first among them, and its later batches committed as orphans;
    now they take reused pages, down to their floor, and the put keeps its head."""
    core = core_ssd
    others = _fill_reused(core)
    probation = [k for k in others if not any(k in o.residency.protected for o in core.residence.landing_orders.all())]
    assert core.remove(NS, probation) == len(probation)

    def round_while_open(start: int) -> None:
        while core.demote_one():
            pass

    put = _keys("put", 64)
    _put_in_batches(core, put, round_while_open)
    round_while_open(64)
    assert _in_host(core, put[:32]) == [True] * 32, "a demoter round wrote the put's head down"
    assert all(core.residence.stored(k) for k in put)
