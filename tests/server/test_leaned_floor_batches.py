"""A demoter's round names its victims as a batch, each pinned as moving (Pins.moving: it counts
as gone), and must name what the same victims evicted one at a time would: the floor protected
pages keep against a put being written (eviction.LEANED_FLOOR, DESIGN §6) counts them gone too.

Bug pinned: the floor was checked on the protected pages still held, moving ones included, so a
round that started above the floor took protected pages until it ended, far below the floor
(60 protected of 100 resident, a round of 40: all 40 protected, where one at a time 34 go,
then 6 of the put's chain, tail first)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from kvstore.server.leases import Pins, PinsAnd
from kvstore.server.placement.eviction import LEANED_FLOOR, HostResidency


def _keys(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def _residency(reused: int = 60, put: int = 40) -> tuple[HostResidency, list[bytes], list[bytes]]:
    """``reused`` pages in chains of 10, each used again (protected), and a put's chain of
    ``put`` pages in probation, its last page leaned on by the put's next (open) batch."""
    residency = HostResidency(protected_share=0.8)
    chains = [_keys(f"reused{n}", 10) for n in range(reused // 10)]
    put_keys = _keys("put", put)
    for chain in [*chains, put_keys]:
        for i, key in enumerate(chain):
            residency.add(key, chain[i - 1] if i else None)
    for chain in chains:
        for key in chain:
            residency.touch(key)
    flat = [key for chain in chains for key in chain]
    assert len(residency.protected) == reused and list(residency.lru) == put_keys
    return residency, flat, put_keys


def _one_at_a_time(n: int) -> list[bytes]:
    residency, _, put = _residency()
    named: list[bytes] = []
    for _ in range(n):
        victim = residency.victim(PinsAnd(Pins(), Counter([put[-1]])))
        assert victim is not None
        residency.remove(victim, evicted=True)
        named.append(victim)
    return named


def _as_a_batch(n: int) -> list[bytes]:
    residency, _, put = _residency()
    pins = Pins()
    kept = PinsAnd(pins, Counter([put[-1]]))
    named: list[bytes] = []
    for _ in range(n):
        victim = residency.victim(kept)
        assert victim is not None
        ranked = residency.priorities(kept)
        assert ranked[victim] == min(ranked.values())
        pins.update([victim])
        pins.pin_moves([victim])
        named.append(victim)
    return named


@pytest.mark.parametrize("n", [20, 40, 64])
def test_a_round_names_what_one_eviction_at_a_time_would(n: int) -> None:
    assert _as_a_batch(n) == _one_at_a_time(n)


def test_a_round_takes_protected_pages_no_lower_than_the_floor() -> None:
    """Protected goes down to the floor (a share of the resident pages, which the round lowers),
    then the put's chain, tail first (its leaned last page, then the rest as probation)."""
    _, reused, put = _residency()
    named = _as_a_batch(40)
    left, resident = 60 - sum(key in reused for key in named), 100 - len(named)
    assert left >= LEANED_FLOOR * 0.8 * resident - 1, f"the round left {left} protected pages of {resident}"
    mine = [key for key in named if key in put]
    assert mine and mine == put[::-1][:len(mine)], "the put's chain goes tail first"
