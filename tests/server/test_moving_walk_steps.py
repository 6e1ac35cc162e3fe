"""A victim search walks the pages a round is moving down once, not once from each of them.

Bug pinned: a walk may start at a page being moved (DESIGN §6: an orphan being moved leads to
the pages after it), and a walk that met only pages being moved blocked nothing, so a round
that named a whole 64-page chain, the least recently used, made every search while its write
was in flight walk that chain from each of its pages: 2,080 steps before the first page that
could go (a demoter's round of 64 on such a chain cost 1.9 ms a search, 50 times the walk
that ended at a page being moved)."""

from __future__ import annotations

from support.chain_steps import count_steps

from kvstore.server.leases import Pins
from kvstore.server.placement.eviction import HostResidency


def _chain(tag: bytes, n: int) -> list[bytes]:
    return [tag + i.to_bytes(4, "big") + bytes(11) for i in range(n)]


def test_a_search_walks_a_chain_being_moved_once() -> None:
    order = HostResidency()
    moved, other = _chain(b"m", 64), _chain(b"o", 64)
    for chain in (moved, other):  # the chain a round names first, then one that may go
        for i, key in enumerate(chain):
            order.add(key, chain[i - 1] if i else None)
    pins = Pins()
    for _ in moved:  # the round names the whole chain, tail first
        victim = order.victim(pins)
        assert victim in moved
        pins.update([victim])
        pins.pin_moves([victim])
    steps = count_steps(order.links)
    assert order.victim(pins) == other[-1]
    assert steps() <= 2 * (len(moved) + len(other)), f"{steps()} chain steps for one search past {len(moved)} pages being moved"
