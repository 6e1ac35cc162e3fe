"""Each eviction order is one priority function (DESIGN §6): under random traffic (pages
stored in prefixes, used, hinted, consumed, expired, removed, evicted as named) and random
pins, the victim an order names in O(1) a page is always one of the least priority its
``priorities`` gives, and it names none exactly when that gives none. A scenario test
proves one interleaving; this holds the fast orders to their definition on thousands."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Container

import pytest

from kvstore.config import HostTierConfig
from kvstore.server.leases import Pins, PinsAnd
from kvstore.server.placement.eviction import HostResidency
from kvstore.server.placement.orders import HostOrder, LruOrder, TailFirstOrder

KEYS = [bytes([i]) * 16 for i in range(36)]
CHAINS = [KEYS[i : i + 6] for i in range(0, len(KEYS), 6)]  # six prefixes of six pages
PARENT = {key: chain[i - 1] for chain in CHAINS for i, key in enumerate(chain) if i}


def _parent(rng: random.Random, key: bytes) -> bytes | None:
    """The page a writer names before ``key``: its prefix's mostly, none sometimes, and now and
    then another page (two prefixes sharing a head: a chain that branches)."""
    draw = rng.random()
    return PARENT.get(key) if draw < 0.85 else rng.choice(KEYS) if draw < 0.92 else None


def _held_to_its_priorities(victim: bytes | None, ranked: dict[bytes, tuple[float, ...]], what: str) -> None:
    if not ranked:
        assert victim is None, f"{what}: named {victim!r} though no page may go"
        return
    assert victim in ranked, f"{what}: named {victim!r}, which may not go now"
    assert ranked[victim] == min(ranked.values()), f"{what}: named {ranked[victim]}, least is {min(ranked.values())}"


def _traffic(rng: random.Random, stored: set[bytes], now: float) -> tuple[str, bytes, float]:
    key = rng.choice(KEYS)
    op = rng.choices(["store", "touch", "remove", "hint", "consume", "expire", "evict"], [6, 4, 1, 2, 2, 1, 4])[0]
    if op in ("touch", "remove", "consume") and stored:
        key = rng.choice(sorted(stored))
    return op, key, now + rng.uniform(0.0, 5.0)


@pytest.mark.parametrize("seed", range(12))
def test_the_host_order_names_a_page_of_the_least_priority(seed: int) -> None:
    rng = random.Random(seed)
    residency = HostResidency(segmented=seed % 3 != 0, protected_share=rng.choice([0.5, 0.8]), ghost_pages=8)
    stored: set[bytes] = set()
    now = 0.0
    for step in range(400):
        now += 0.01
        op, key, eta = _traffic(rng, stored, now)
        if op == "store" and key not in stored:
            residency.add(key, _parent(rng, key))
            stored.add(key)
        elif op == "touch":
            residency.touch(key)
        elif op == "remove" and key in stored:
            residency.remove(key)
            stored.discard(key)
        elif op == "hint":
            residency.hint(key, round(eta, 1), depth=rng.randrange(6))  # rounded: equal uses happen
        elif op == "consume":
            residency.consume(key, now + rng.uniform(0.0, 3.0))
        elif op == "expire":
            residency.expire(now + rng.uniform(0.0, 4.0), 0.5)
        pinned: Container[bytes] = {k for k in sorted(stored) if rng.random() < 0.15}
        if rng.random() < 0.5:  # and parents open allocations lean on: kept, save in an orphan's chain
            pins = Pins()
            pins.update(pinned)
            pinned = PinsAnd(pins, Counter(k for k in sorted(stored) if rng.random() < 0.1))
        share = rng.choice([None, 0, 2, 6])
        victim = residency.victim(pinned, share)
        _held_to_its_priorities(victim, residency.priorities(pinned, share), f"seed {seed} step {step} ({op})")
        if op == "evict" and rng.random() < 0.5:
            _demotion_batch(residency, stored, rng, f"seed {seed} step {step}")
        elif op == "evict" and victim is not None:  # named, then written down or dropped: the shortcuts' path
            residency.remove(victim, evicted=True)
            stored.discard(victim)


def _demotion_batch(residency: HostResidency, stored: set[bytes], rng: random.Random, what: str) -> None:
    """The demoter's round: victims named one after another, each pinned as moving (the walk goes
    through it, never names it: Pins.moving), every one held to the priorities, now and then a
    page committed after one of them while the round's write is in flight (a put's next batch:
    that chain's tail now); then they leave in the order named, as the batch's write ends (the
    moving shortcut's path)."""
    pins = Pins()
    pins.update(k for k in sorted(stored) if rng.random() < 0.1)
    kept: Container[bytes] = pins
    if rng.random() < 0.5:  # the demoter's search passes over what open allocations lean on too (Leases.kept)
        kept = PinsAnd(pins, Counter(k for k in sorted(stored) if rng.random() < 0.15))
    named: list[bytes] = []
    for _ in range(rng.randint(2, 6)):
        victim = residency.victim(kept)
        _held_to_its_priorities(victim, residency.priorities(kept), f"{what} (batch of {len(named) + 1})")
        if victim is None:
            break
        pins.update([victim])
        pins.pin_moves([victim])
        named.append(victim)
        if rng.random() < 0.3 and (free := [k for k in KEYS if k not in stored]):
            key = rng.choice(free)
            residency.add(key, rng.choice(named))
            stored.add(key)
    for victim in named:
        residency.remove(victim, evicted=True)
        stored.discard(victim)


@pytest.mark.parametrize("seed", range(8))
def test_the_ssd_and_pool_orders_name_a_page_of_the_least_priority(seed: int) -> None:
    rng = random.Random(1000 + seed)
    orders = {"ssd": TailFirstOrder(), "pool": LruOrder()}
    stored: set[bytes] = set()
    for step in range(400):
        op, key, _ = _traffic(rng, stored, 0.0)
        for name, order in orders.items():
            if op == "store":
                order.stored(key, _parent(rng, key))
            elif op == "touch":
                order.touch(key)
            elif op == "remove":
                order.removed(key, evicted=False)
        stored = stored | {key} if op == "store" else stored - {key} if op == "remove" else stored
        pinned = {k for k in sorted(stored) if rng.random() < 0.15}
        for name, order in orders.items():
            victim = order.victim(pinned, 1)
            _held_to_its_priorities(victim, order.priorities(pinned, 1), f"{name} seed {seed} step {step} ({op})")
            if op == "evict" and victim is not None:
                order.removed(victim, evicted=True)
        if op == "evict":
            stored = {k for k in stored if all(k in order for order in orders.values())}


def test_the_host_order_in_its_lock_gives_the_same_priorities() -> None:
    """HostOrder (the core's object, with its hint share) answers the residency's function."""
    order = HostOrder(HostTierConfig(capacity_bytes=64 << 20))
    for chain in CHAINS[:2]:
        for i, key in enumerate(chain):
            order.stored(key, chain[i - 1] if i else None)
    ranked = order.priorities(set(), 1 << 20)
    assert order.victim(set(), 1 << 20) == min(ranked, key=ranked.__getitem__) == CHAINS[0][-1]


@pytest.mark.parametrize("order_kind", ["host", "ssd"])
def test_a_remembered_chain_end_stored_again_elsewhere_is_not_its_chain_end(order_kind: str) -> None:
    """The shortcut a tail-first eviction leaves (the page before its victim: that chain's end
    next) names that page only while it is that chain's end. Removed (not as a victim, say
    invalidated) and stored again with no parent, or after another page, it is the newest
    page of another chain: the next victim is the old chain's end, not it (DESIGN §6)."""
    a, b = CHAINS[0][:4], CHAINS[1][:2]
    if order_kind == "host":
        residency = HostResidency(segmented=False)
        store, remove = residency.add, residency.remove

        def victim() -> bytes | None:
            return residency.victim(set())

        def ranked() -> dict[bytes, tuple[float, ...]]:
            return dict(residency.priorities(set()))
    else:
        order = TailFirstOrder()
        store, remove = order.stored, order.removed  # type: ignore[assignment]

        def victim() -> bytes | None:
            return order.victim(set(), 1)

        def ranked() -> dict[bytes, tuple[float, ...]]:
            return order.priorities(set(), 1)
    for chain in (a, b):
        for i, key in enumerate(chain):
            store(key, chain[i - 1] if i else None)
    assert victim() == a[3]
    remove(a[3], True)  # evicted as named: the shortcut remembers a[2], the chain's end now
    assert victim() == a[2]
    remove(a[2], False)  # removed otherwise (invalidated), then written again on its own
    store(a[2], None)
    named = victim()
    _held_to_its_priorities(named, ranked(), order_kind)
    assert named == a[1]  # the least recently used chain's end; a[2] is the newest page


def test_a_demotion_batch_takes_a_branchs_other_tail_before_the_page_they_share() -> None:
    """Two prefixes sharing a head (p, then v or w): a demotion batch names one tail, pins it as
    moving, and asks again; the page before it (p) still has the other tail after it, so the next
    victim is that tail, not p (the moving shortcut checks p has no other page after it)."""
    c, p, v, w = KEYS[:4]
    order = TailFirstOrder()
    for key, parent in ((c, None), (p, c), (v, p), (w, p)):
        order.stored(key, parent)
    pins = Pins()
    first = order.victim(pins, 1)
    assert first in (v, w)
    pins.update([first])
    pins.pin_moves([first])
    second = order.victim(pins, 1)
    _held_to_its_priorities(second, order.priorities(pins, 1), "second of the batch")
    assert second == ({v, w} - {first}).pop()
