"""A victim search walks a chain whose last page an open allocation leans on once, not again at
every search while the lean holds (DESIGN §6).

Bug pinned: a put written in batches leans on its last committed page while its next batch is
open, so the chain stays in RAM while other puts evict beside it; every one of their searches
walked the put's chain from its head to the page leaned on before passing it (O(its length) a
search): a 3,072-page put with each batch open while other puts evicted, in-process, spent 15.1 s
of 20.4 s CPU in ``victim``. ``TailFirst`` now remembers a kept chain until its end or a link
changes."""

from __future__ import annotations

from collections import Counter

from support.chain_steps import count_steps

from kvstore.server.leases import Pins, PinsAnd
from kvstore.server.placement.eviction import HostResidency


def _chain(tag: bytes, n: int) -> list[bytes]:
    return [tag + i.to_bytes(4, "big") + bytes(11) for i in range(n)]


def test_searches_beside_a_leaned_chain_walk_it_once() -> None:
    order = HostResidency()
    put = _chain(b"p", 256)
    for i, key in enumerate(put):  # the put's batches so far, least recently used
        order.add(key, put[i - 1] if i else None)
    others = [_chain(b"o%03d" % n, 4) for n in range(64)]  # other puts', each evicted in turn
    for chain in others:
        for i, key in enumerate(chain):
            order.add(key, chain[i - 1] if i else None)
    kept = PinsAnd(Pins(), Counter([put[-1]]))  # the put's next batch is open: it leans on its end
    steps = count_steps(order.links)
    for chain in others:
        for key in reversed(chain):
            victim = order.victim(kept)
            assert victim == key, "the other puts' pages go, tail first, the leaned chain stays"
            order.remove(victim, evicted=True)
    searches = sum(map(len, others))
    assert steps() <= len(put) + 4 * searches, f"{steps()} chain steps for {searches} searches beside a {len(put)}-page leaned chain"
    assert order.victim(PinsAnd(Pins(), Counter())) == put[-1], "the lean let go: the chain's tail goes"


def test_a_round_over_a_chain_whose_tail_is_being_moved_names_each_page_in_o1() -> None:
    """A round starts while an earlier write of the same chain's tail is in flight (the lock is
    let go for the I/O: the urgent demoter, a put's own eviction): its first walk goes through
    that moving tail, and its later searches take the round's shortcut, as with no tail moving.
    Bug pinned (found by review of the kept chains' change): the shortcut was taken only after a
    walk that ended at its own last page, so each of the round's 64 searches walked the whole
    4,096-page chain again (262,144 chain steps; 4,159 before that change and after this fix)."""
    order = HostResidency()
    chain = _chain(b"c", 4096)
    for i, key in enumerate(chain):
        order.add(key, chain[i - 1] if i else None)
    pins = Pins()
    pins.update([chain[-1]])
    pins.pin_moves([chain[-1]])  # the earlier write, in flight
    steps = count_steps(order.links)
    for i in range(64):
        victim = order.victim(pins)
        assert victim == chain[-2 - i]
        pins.update([victim])
        pins.pin_moves([victim])
    assert steps() <= len(chain) + 4 * 64, f"{steps()} chain steps for a 64-page round"
