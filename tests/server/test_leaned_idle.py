"""What an open allocation leans on (its parent, with a tier below: DESIGN §6) is in the core's
view, and an idle core leans on nothing: every way an allocation ends (commit, abort, expiry,
a refused commit, a failed allocate) lets go of it once, and the idle checks tests make see a leak.

Gap pinned: ``CoreView.idle`` read pins, leases and allocations, not ``Leases.leaned``, so a
leaned parent left behind by some path (a chain kept from eviction for ever) passed every check.
"""

from __future__ import annotations

import time

import pytest
from support.core_pages import LAYOUT, CorePages, page_keys
from support.servers import make_config

from kvstore.errors import StaleGeneration, TierFull
from kvstore.server.placement import Placement

NS = b"leaned-idle-ns"
PAGES = CorePages(NS)
_keys, _allocate, _commit = page_keys, PAGES.allocate, PAGES.commit


@pytest.fixture
def core(tmp_path):
    core = Placement(make_config(tmp_path, host_bytes=4 << 20, allocation_ttl_ms=300))
    yield core
    core.close()


def test_every_end_of_an_allocation_lets_go_of_its_leaned_parent(core: Placement) -> None:
    head = _keys("head", 4)
    assert _commit(core, _allocate(core, head), head) == 4
    tail = _keys("tail", 4)
    alloc = _allocate(core, tail, parent=head[-1])
    assert core.view().leaned == {head[-1]} and not core.view().idle
    assert _commit(core, alloc, tail) == 4
    assert core.view().idle, core.view()
    core.abort(_allocate(core, _keys("aborted", 4), parent=tail[-1]))
    assert core.view().idle, core.view()
    _allocate(core, _keys("expired", 4), parent=tail[-1])
    time.sleep(0.4)
    core.stats()  # reaps what expired
    assert core.view().idle, core.view()
    refused = _keys("refused", 4)
    alloc = _allocate(core, refused, parent=tail[-1])
    core.invalidate(NS, [])  # the namespace's generation goes up: the commit is refused
    with pytest.raises(StaleGeneration):
        _commit(core, alloc, refused)
    assert core.view().idle, core.view()
    everything = _allocate(core, _keys("fill", 128))  # every slot reserved: the next allocation finds no room
    with pytest.raises(TierFull):
        core.allocate(NS, LAYOUT, _keys("no-room", 2), parent=tail[-1])
    core.abort(everything)
    assert core.view().idle, core.view()


def test_a_parent_leaned_on_with_no_allocation_is_not_idle(core: Placement) -> None:
    core.leases.lean(b"k" * 16)  # what a path that never let go would leave
    assert not core.view().idle
    core.leases.unlean(b"k" * 16)
    assert core.view().idle, core.view()
