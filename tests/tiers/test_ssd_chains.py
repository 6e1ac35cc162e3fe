"""The SSD tier gives up the tail of a prefix before its head, as the host tier does, and
keeps the links that say so across a restart (in its index).

Bug pinned: the SSD tier evicted in commit/touch order, and a durable put (or a read from
SSD) stores or touches a prefix head first, so its head was its oldest page: the first
eviction made the rest of the prefix unfindable (lookups are prefix lookups) while it
kept taking room.
"""

from __future__ import annotations

import dataclasses
import hashlib

from support.servers import make_config

from kvstore.config import SsdTierConfig
from kvstore.page import LayoutDesc, PageHeader, checksum
from kvstore.server.placement import Placement
from kvstore.server.placement.chains import PrefixLinks
from kvstore.server.placement.orders import TailFirstOrder
from kvstore.tiers.ssd import SsdTier

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages
NS = b"ssd-chain-namesp"


def _keys(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def _payload(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (LAYOUT.page_bytes // 64)


def _store(tier: SsdTier, keys: list[bytes], parents: list[bytes | None]) -> None:
    pages = []
    for key in keys:
        header = PageHeader(NS, key, LAYOUT, LAYOUT.page_bytes, checksum(_payload(key)), 0)
        slot = tier.reserve(LAYOUT.page_bytes)
        assert slot is not None
        tier.write([(slot, header, memoryview(_payload(key)))])
        pages.append((slot, header))
    tier.commit(pages, parents)


def test_ssd_evicts_a_chain_tail_first_and_keeps_its_links_across_a_restart(tmp_path) -> None:
    config = SsdTierConfig(directory=tmp_path / "ssd", capacity_bytes=16 << 20)
    chain, other = _keys("chain", 6), _keys("other", 2)
    order = TailFirstOrder()  # the core's order of the tier, told what it stores
    tier = SsdTier(config, events=order)
    try:
        _store(tier, chain[:3], [None, chain[0], chain[1]])
        _store(tier, other, [None, other[0]])
        _store(tier, chain[3:], chain[2:5])  # a later batch of the same prefix
        assert order.victim(set(), LAYOUT.page_bytes) == chain[5]
        for key in chain:  # read again (a read-up touches head first): the chain is newest now
            order.touch(key)
        assert order.victim(set(), LAYOUT.page_bytes) == other[1]
        assert order.victim({other[1]}, LAYOUT.page_bytes) == chain[5]  # a reader of other[1] keeps other[0]
    finally:
        tier.close()
    order = TailFirstOrder()
    tier = SsdTier(config, events=order)  # a restart: the links come back from the index
    try:
        got = []
        while (victim := order.victim(set(), LAYOUT.page_bytes)) is not None:
            got.append(victim)
            tier.delete([victim], evicted=True)
        assert got.index(chain[5]) < got.index(chain[4]) < got.index(chain[3]) < got.index(chain[0]), \
            [chain.index(k) if k in chain else "other" for k in got]
        assert got.index(other[1]) < got.index(other[0])
    finally:
        tier.close()


def test_a_durable_prefix_stays_findable_while_the_ssd_evicts_it(tmp_path) -> None:
    """A durable put, then other puts through RAM and down to a full SSD: whenever the SSD
    has given up part of the durable prefix, what is left of it is a prefix a lookup finds."""
    config = make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)
    config = dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, slab_bytes=1 << 20))
    core = Placement(config)
    try:
        durable = _keys("durable", 40)
        alloc, slots = core.allocate(NS, LAYOUT, durable)
        for key, _ in slots:
            core.slot_view(alloc, key)[:] = _payload(key)
        assert core.commit(alloc, durable, [checksum(_payload(k)) for k in durable], durable=True) == 40
        checked = 0
        for n in range(300):
            keys = _keys(f"other{n}", 8)
            alloc, slots = core.allocate(NS, LAYOUT, keys)
            for key, _ in slots:
                core.slot_view(alloc, key)[:] = _payload(key)
            core.commit(alloc, keys, [checksum(_payload(k)) for k in keys])
            held = [bool(core.where(k)) for k in durable]
            if all(held):
                continue
            found = core.directory.prefix_length(NS, durable)
            assert held == sorted(held, reverse=True), f"the node holds pieces of the prefix: {held}"
            assert found == sum(held), (found, sum(held))
            checked += 1
            if sum(held) < 20:
                break
        assert checked, "the SSD never evicted the durable prefix: the test proves nothing"
        assert 0 < sum(held) < 40
    finally:
        core.close()


def test_a_cycle_a_writer_made_up_costs_a_victim_search_its_length_not_the_tiers_size() -> None:
    """Links are the writers' word: a tenant may name any page as a page's parent, so two pages
    that name each other make a cycle. Bug: ``deepest`` walked it until its bound, the number
    of links the tier holds (an SSD tier's: every page's), under the tier's lock, for each
    cycle a victim search met: a tenant writing 2-page cycles made every SSD eviction a walk
    of the whole index."""
    links = PrefixLinks()
    for key, parent in zip(_keys("other", 20_000), _keys("other-parent", 20_000)):
        links.link(key, parent)  # 20,000 pages of other prefixes
    a, b = _keys("cycle", 2)
    links.link(a, b)
    links.link(b, a)
    asked: list[bytes] = []

    def evictable(key: bytes) -> bool:
        asked.append(key)
        return True

    assert links.deepest(a, evictable, (), set()) in (a, b)  # a cycle's page goes like any other
    assert len(asked) <= 4, f"a 2-page cycle took {len(asked)} steps of the victim search"
