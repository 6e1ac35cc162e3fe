"""Hinted pages go last (DESIGN §6), after the chain an open allocation leans on too: leaning
orders that chain after the other unannounced pages, not after the pages a queued request
announced.

Bug pinned: the chain an open allocation leaned on was passed over as if pinned, so a victim
search with nothing else unannounced took the hinted pages first (a queued request's prefix,
read up ahead of use) and only then, in a second search over the pins alone, the put's chain;
and ``priorities``, the order's definition, did not rank that chain at all.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from support.core_pages import CorePages, page_keys
from support.servers import make_config

from kvstore.server.leases import Pins, PinsAnd
from kvstore.server.placement import Placement
from kvstore.server.placement.eviction import HostResidency

NS = b"hinted-namespace"
PAGES = CorePages(NS)
_keys, _put = page_keys, PAGES.put


def test_a_put_at_ram_size_takes_its_own_chain_before_the_hinted_pages(tmp_path) -> None:
    """48 pages hinted (a queued request's, within the hint share of 64), then a put of 88
    pages in batches of 8: the last batch needs room, and only the put's chain (leaned on)
    and the hinted pages are left. The put's tail goes down; the hinted pages stay."""
    core = Placement(make_config(tmp_path, host_bytes=4 << 20, allocation_ttl_ms=30_000))
    try:
        queued = _keys("queued", 48)
        assert _put(core, queued) == 48
        assert core.hint(NS, queued, 60.0)
        put, parent = _keys("put", 88), None
        for start in range(0, 88, 8):
            assert _put(core, put[start:start + 8], parent) == 8
            parent = put[start + 7]
        assert [core.residence.has(k, 0) for k in queued] == [True] * 48, "a put took hinted pages before its own"
        assert core.directory.prefix_length(NS, put) == 88, "the put is not found whole"
        assert core.view().idle, core.view()
    finally:
        core.close()


def test_the_order_ranks_a_leaned_chain_after_the_unannounced_and_before_the_hinted() -> None:
    residency = HostResidency()
    chain_keys, hinted = _keys("chain", 3), _keys("hinted", 2)
    residency.add(chain_keys[0])
    for before, key in pairwise(chain_keys):
        residency.add(key, before)
    for key in hinted:
        residency.add(key)
        residency.hint(key, 100.0)
    kept = PinsAnd(Pins(), Counter([chain_keys[-1]]))
    assert residency.victim(kept, 8) == chain_keys[-1]
    ranked = residency.priorities(kept, 8)
    assert min(ranked, key=ranked.__getitem__) == chain_keys[-1]
    assert all(ranked[chain_keys[-1]] < ranked[k] for k in hinted)
