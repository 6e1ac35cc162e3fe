"""The lookup's plan cache (kvstore/server/cluster/lookup.py): a cached plan is the plan
``plan_lookup`` makes, and a membership change (a new shard map) never reuses a plan of the
old member set."""

from __future__ import annotations

import os

from kvstore.cluster.shards import ShardConfig, ShardMap, plan_lookup
from kvstore.server.cluster.lookup import PlanCache

CONFIG = ShardConfig(segment_pages=1, replicas=1)


def test_cached_plan_is_the_plan_and_its_keys() -> None:
    keys = [os.urandom(16) for _ in range(64)]
    shard_map = ShardMap(["a", "b", "c"], CONFIG)
    cache = PlanCache()
    plan, asked = cache.get(keys, shard_map)
    fresh = plan_lookup(keys, shard_map)
    assert plan.asked == fresh.asked and plan.requests() == fresh.requests()
    for owner, ranges in fresh.requests().items():
        assert asked[owner] == [k for rng in ranges for k in keys[rng.start : rng.stop]]
    assert sorted(k for ks in asked.values() for k in ks) == sorted(keys)
    again, _ = cache.get(list(keys), shard_map)  # equal keys, other list: the same plan
    assert again is plan


def test_new_member_set_plans_afresh() -> None:
    keys = [os.urandom(16) for _ in range(64)]
    cache = PlanCache()
    before, _ = cache.get(keys, ShardMap(["a", "b", "c"], CONFIG))
    after, asked = cache.get(keys, ShardMap(["a", "c"], CONFIG))  # b left
    assert "b" in before.requests() and "b" not in after.requests() and "b" not in asked
    assert after.asked == plan_lookup(keys, ShardMap(["a", "c"], CONFIG)).asked


def test_bounded() -> None:
    shard_map = ShardMap(["a", "b"], CONFIG)
    cache = PlanCache()
    for _ in range(PlanCache.MAX_PLANS + 10):
        cache.get([os.urandom(16)], shard_map)
    assert len(cache._plans) == PlanCache.MAX_PLANS  # read only: the bound holds
