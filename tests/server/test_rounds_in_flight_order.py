"""The eviction orders under random traffic with a demoter's round in flight (DESIGN §6): a round
names victims, pinned as moving; searches beside it (with pins of their own) name victims while its
write runs; it ends written (its pages leave) or failed (its pins go, its pages stay). Each victim
is one of the least ``priorities``, never a page being moved, and (unless hinted: those go by their
announced use) has no page after it that is not being moved. test_eviction_priority holds the orders
without rounds in flight. Seeds failing: 28 of 60 on 8409074 (the walk ended at a page being moved
and named the one before it), 2 on 6d1dd43 (the round's shortcut outliving a failed round)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Container

import pytest

from kvstore.server.leases import Pins, PinsAnd
from kvstore.server.placement.chains import PrefixLinks
from kvstore.server.placement.eviction import HostResidency
from kvstore.server.placement.orders import TailFirstOrder

KEYS = [bytes([i]) * 16 for i in range(30)]
CHAINS = [KEYS[i : i + 6] for i in range(0, len(KEYS), 6)]  # five prefixes of six pages
PARENT = {key: chain[i - 1] for chain in CHAINS for i, key in enumerate(chain) if i}


def _parent(rng: random.Random, key: bytes) -> bytes | None:
    return PARENT.get(key) if rng.random() < 0.9 else None  # linear chains: a writer names its prefix's page, or none


def _held_to_the_order(links: PrefixLinks, victim: bytes | None, ranked: dict[bytes, tuple[float, ...]],
                       held: Callable[[bytes], bool], pinned: Container[bytes], what: str) -> None:
    if not ranked:
        assert victim is None, f"{what}: named {victim!r} though no page may go"
        return
    assert victim in ranked and ranked[victim] == min(ranked.values()), f"{what}: named {ranked.get(victim)}, least {min(ranked.values())}"
    moving: Container[bytes] = getattr(pinned, "moving", ())
    assert victim not in moving, f"{what}: named a page being moved"
    if not held(victim):
        return  # a hinted page: named by its next announced use, not by its chain (DESIGN §6)
    after, page = [], victim
    while (nxt := [k for k in links.after(page) if held(k)]) and len(after) < len(KEYS):
        page = nxt[0]
        after.append(page)
    assert all(k in moving for k in after), f"{what}: named a page with pages after it that stay"


def _pins(rng: random.Random, stored: set[bytes], moves: float, callers: float) -> Pins:
    pins = Pins()
    for key in sorted(stored):
        if rng.random() < callers:
            pins.update([key])
        if rng.random() < moves:
            pins.update([key])
            pins.pin_moves([key])
    return pins


def _unpin(pins: Pins, keys: list[bytes], move: bool) -> None:
    if move:
        pins.unpin_moves(keys)
    pins.subtract(keys)
    for key in keys:
        if pins[key] <= 0:
            del pins[key]


class _Round:
    """A demoter's round in flight: its pins (the named victims as moves), what its search passed
    over, and what it named."""

    def __init__(self, pins: Pins, kept: Container[bytes]) -> None:
        self.pins, self.kept, self.named = pins, kept, []  # type: list[bytes]


@pytest.mark.parametrize("seed", range(40))
def test_the_host_order_with_a_round_in_flight(seed: int) -> None:
    rng = random.Random(seed)
    order = HostResidency(segmented=seed % 3 != 0, protected_share=rng.choice([0.5, 0.8]), ghost_pages=8)
    stored: set[bytes] = set()
    flight: _Round | None = None
    now = 0.0
    for step in range(300):
        now += 0.01
        what = f"seed {seed} step {step}"
        key = rng.choice(KEYS)
        op = rng.choices(["store", "touch", "remove", "hint", "consume", "expire", "evict", "round", "end"],
                         [6, 4, 1, 2, 2, 1, 3, 2, 1])[0]
        if op in ("touch", "remove", "consume") and stored:
            key = rng.choice(sorted(stored))
        if op == "store" and key not in stored:
            order.add(key, _parent(rng, key))
            stored.add(key)
        elif op == "touch":
            order.touch(key)
        elif op == "remove" and key in stored and not (flight and key in flight.named):
            order.remove(key)
            stored.discard(key)
        elif op == "hint":
            order.hint(key, round(now + rng.uniform(0.0, 5.0), 1), depth=rng.randrange(6))
        elif op == "consume":
            order.consume(key, now + rng.uniform(0.0, 3.0))
        elif op == "expire":
            order.expire(now + rng.uniform(0.0, 4.0), 0.5)
        elif op == "round" and flight is None:
            pins = _pins(rng, stored, 0.0, 0.1)
            flight = _Round(pins, pins if rng.random() < 0.5 else PinsAnd(pins, Counter(k for k in sorted(stored) if rng.random() < 0.15)))
            for _ in range(rng.randint(1, 8)):
                victim = order.victim(flight.kept)
                _held_to_the_order(order.links, victim, order.priorities(flight.kept), order._unannounced, flight.kept, f"{what} round")
                if victim is None:
                    break
                flight.pins.update([victim])
                flight.pins.pin_moves([victim])
                flight.named.append(victim)
        elif op == "end" and flight is not None:
            _unpin(flight.pins, flight.named, True)
            if rng.random() < 0.6:  # written: its pages leave, in the order named mostly
                for victim in flight.named if rng.random() < 0.7 else rng.sample(flight.named, len(flight.named)):
                    if victim in stored:
                        order.remove(victim, evicted=True)
                        stored.discard(victim)
            flight = None
        if flight is not None and rng.random() < 0.7:  # a search beside the round: its pins, and more
            pins, kept = flight.pins, flight.kept
            callers = [k for k in sorted(stored) if rng.random() < 0.05]
            moves = [k for k in sorted(stored) if rng.random() < 0.05]
            pins.update(callers + moves)
            pins.pin_moves(moves)
        else:
            pins, callers, moves = _pins(rng, stored, 0.15, 0.12), [], []
            kept = pins if rng.random() < 0.5 else PinsAnd(pins, Counter(k for k in sorted(stored) if rng.random() < 0.1))
        victim = order.victim(kept)
        _held_to_the_order(order.links, victim, order.priorities(kept), order._unannounced, kept, f"{what} ({op})")
        if op == "evict" and victim is not None and rng.random() < 0.5:
            order.remove(victim, evicted=True)
            stored.discard(victim)
        if flight is not None:
            _unpin(pins, callers, False)
            _unpin(pins, moves, True)


@pytest.mark.parametrize("seed", range(20))
def test_the_ssd_order_with_a_round_in_flight(seed: int) -> None:
    rng = random.Random(5000 + seed)
    order = TailFirstOrder()
    stored: set[bytes] = set()
    flight: _Round | None = None
    for step in range(300):
        what = f"seed {seed} step {step}"
        key = rng.choice(KEYS)
        op = rng.choices(["store", "touch", "remove", "evict", "round", "end"], [6, 3, 1, 3, 2, 1])[0]
        if op in ("touch", "remove") and stored:
            key = rng.choice(sorted(stored))
        if op == "store":
            order.stored(key, _parent(rng, key))
            stored.add(key)
        elif op == "touch":
            order.touch(key)
        elif op == "remove" and key in stored and not (flight and key in flight.named):
            order.removed(key, False)
            stored.discard(key)
        elif op == "round" and flight is None:
            pins = _pins(rng, stored, 0.0, 0.1)
            flight = _Round(pins, pins)
            for _ in range(rng.randint(1, 6)):
                victim = order.victim(pins, 1)
                _held_to_the_order(order.chains.links, victim, order.priorities(pins, 1), order.keys.__contains__, pins,
                                   f"{what} round")
                if victim is None:
                    break
                pins.update([victim])
                pins.pin_moves([victim])
                flight.named.append(victim)
        elif op == "end" and flight is not None:
            _unpin(flight.pins, flight.named, True)
            for victim in flight.named:
                if victim in stored and rng.random() < 0.7:
                    order.removed(victim, True)
                    stored.discard(victim)
            flight = None
        pins = flight.pins if flight is not None else _pins(rng, stored, 0.15, 0.12)
        victim = order.victim(pins, 1)
        _held_to_the_order(order.chains.links, victim, order.priorities(pins, 1), order.keys.__contains__, pins, f"{what} ({op})")
        if op == "evict" and victim is not None and not (flight and victim in flight.named):
            order.removed(victim, True)
            stored.discard(victim)
