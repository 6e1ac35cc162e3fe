"""The lookup's answer cache (server/cluster/lookup.py) lets go of what expired: before, an
expired record stayed until 65,536 had piled up (then all went at once), so a node whose
lookups name new chains all the time held tens of MB of dead records between two clears."""

from __future__ import annotations

from support.clock import Clock

from kvstore.server.cluster.lookup import AnswerCache

NS = bytes(16)


def _fill(cache: AnswerCache, first: int, count: int) -> list[bytes]:
    keys = [i.to_bytes(16, "big") for i in range(first, first + count)]
    cache.put(NS, keys, [("b", "host", 4096) for _ in keys])
    return keys


def test_expired_records_go_and_live_ones_stay() -> None:
    clock = Clock()
    cache = AnswerCache(2.0, clock)
    for round_ in range(200):  # 200 TTLs of fresh chains of 64 pages each
        clock.now += 2.5
        live = _fill(cache, round_ * 64, 64)
        assert len(cache.leading(NS, live)) == 64
        assert len(cache._records) <= 2048, "expired records kept"
    clock.now += 1.0  # within the last chain's TTL: still cached; past it: not
    assert len(cache.leading(NS, live)) == 64
    clock.now += 1.5
    assert cache.leading(NS, live) == []


def test_a_record_learned_in_an_older_generation_is_not_read_in_a_newer_one() -> None:
    """An answer names where pages were in the generation it was asked in: once the namespace
    entered a newer one, its holders dropped them. Read again, the fill fetched from a holder that
    answered MISSING at every pull for the cache's whole TTL: a pool handoff's wait right after an
    invalidation answered nothing for its whole deadline (test_handoff_random at seed 29, about
    one run in two), though the pages were stored at another node in the new generation."""
    cache = AnswerCache(60.0, Clock())
    keys = [i.to_bytes(16, "big") for i in range(4)]
    cache.put(NS, keys, [("b", "host", 4096) for _ in keys], generation=4)
    assert len(cache.leading(NS, keys, generation=4)) == 4
    assert cache.leading(NS, keys, generation=5) == []
