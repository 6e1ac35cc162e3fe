"""Properties of the shard arithmetic: rendezvous ownership, what moves on a membership
change, and a one-round prefix lookup merged back to exactly the contiguous prefix."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.cluster.shards import (
    KeyRange,
    ShardConfig,
    ShardMap,
    merge_lookup,
    moves,
    plan_lookup,
    segment_start,
    segments,
)
from kvstore.errors import ConfigError, InvalidRequest

node_ids = st.lists(st.text("abcdefghijklmnop0123456789-", min_size=1, max_size=6), min_size=1, max_size=12, unique=True)
seg_keys = st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=60, unique=True)
configs = st.builds(ShardConfig, segment_pages=st.integers(1, 9), replicas=st.integers(1, 4))


def chain(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 1_000_003 + i).to_bytes(16, "little") for i in range(n)]


@given(node_ids, seg_keys, configs, st.randoms())
def test_owners_are_r_distinct_members_whatever_the_order(nodes: list[str], keys: list[bytes], config: ShardConfig,
                                                         rnd: object) -> None:
    shuffled = list(nodes)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    a, b = ShardMap(nodes, config), ShardMap(shuffled, config)
    for key in keys:
        owners = a.owners(key)
        assert owners == b.owners(key)
        assert len(owners) == min(config.replicas, len(nodes)) == len(set(owners))
        assert set(owners) <= set(nodes)


@given(node_ids, st.text("xyz", min_size=1, max_size=3), seg_keys, configs)
def test_a_join_moves_only_segments_the_newcomer_now_owns(nodes: list[str], new: str, keys: list[bytes],
                                                          config: ShardConfig) -> None:
    new = "+" + new  # never among nodes
    before, after = ShardMap(nodes, config), ShardMap([*nodes, new], config)
    moved = {m.segment_key: m for m in moves(keys, before, after)}
    for key in keys:
        if key in moved:
            assert moved[key].gained == (new,) and len(moved[key].lost) <= 1
        else:
            assert new not in after.owners(key)
    # and the leave is the exact reverse
    assert {m.segment_key for m in moves(keys, after, before)} == set(moved)


@given(node_ids, seg_keys, configs, st.data())
def test_a_leave_moves_only_segments_the_leaver_owned(nodes: list[str], keys: list[bytes], config: ShardConfig,
                                                      data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(nodes))
    before, after = ShardMap(nodes, config), ShardMap([n for n in nodes if n != gone], config)
    moved = {m.segment_key for m in moves(keys, before, after)}
    assert moved == {k for k in keys if gone in before.owners(k)}


@pytest.mark.parametrize("n", [3, 16])
def test_a_join_moves_about_one_in_n_plus_one_segments(n: int) -> None:
    keys = [os.urandom(16) for _ in range(20_000)]
    nodes = [f"node-{i}" for i in range(n)]
    moved = moves(keys, ShardMap(nodes, ShardConfig()), ShardMap([*nodes, "new"], ShardConfig()))
    expected = len(keys) / (n + 1)
    sigma = (len(keys) * (1 / (n + 1)) * (n / (n + 1))) ** 0.5
    assert abs(len(moved) - expected) < 5 * sigma, (len(moved), expected)


@given(st.integers(0, 200), configs, node_ids, st.data())
@settings(max_examples=300)
def test_a_lookup_round_merges_to_exactly_the_contiguous_prefix(n: int, config: ShardConfig, nodes: list[str],
                                                                data: st.DataObject) -> None:
    """Model: the holders' records, placed on owners by publish_targets (the real path); the
    answer from a plan and the owners' shards must equal the longest fully present prefix."""
    keys = chain(n)
    held = data.draw(st.sets(st.integers(0, max(n - 1, 0)))) if n else set()
    shard_map = ShardMap(nodes, config)
    shards: dict[str, dict[int, str]] = {node: {} for node in nodes}
    for owner, pages in shard_map.publish_targets(keys, sorted(held)).items():
        for i in pages:
            shards[owner][i] = f"loc-{i}"
    failed = data.draw(st.sets(st.sampled_from(nodes), max_size=2))
    plan = plan_lookup(keys, shard_map)
    requests = plan.requests()
    covered = sorted(i for ranges in requests.values() for r in ranges for i in range(r.start, r.stop))
    assert covered == list(range(n))  # every page asked once, of one owner
    assert len(requests) <= len(plan.segments)
    answers = {owner: None if owner in failed else [[shards[owner].get(i) for i in range(r.start, r.stop)] for r in ranges]
               for owner, ranges in requests.items()}
    found = merge_lookup(plan, answers)
    expected = 0
    while expected < n and expected in held:
        expected += 1
    first_failed = next((s.start for s, o in zip(plan.segments, plan.asked) if o in failed), n)
    assert found == [f"loc-{i}" for i in range(min(expected, first_failed))]


@given(st.integers(1, 120), configs, node_ids)
def test_a_retry_round_skips_failed_owners(n: int, config: ShardConfig, nodes: list[str]) -> None:
    shard_map = ShardMap(nodes, config)
    first = plan_lookup(chain(n), shard_map)
    dead = first.asked[0]
    retry = plan_lookup(chain(n), shard_map, exclude=[dead])  # type: ignore[list-item]
    assert dead not in retry.asked
    for seg, owner in zip(retry.segments, retry.asked):
        alive = [o for o in shard_map.owners(seg.key) if o != dead]
        assert owner == (alive[0] if alive else None)


def test_segments_and_ranges_are_aligned() -> None:
    keys = chain(10)
    segs = segments(keys, 4)
    assert [(s.start, s.stop, s.key) for s in segs] == [(0, 4, keys[0]), (4, 8, keys[4]), (8, 10, keys[8])]
    assert [segment_start(i, 4) for i in (0, 3, 4, 9)] == [0, 0, 4, 8]
    plan = plan_lookup(keys, ShardMap(["only"], ShardConfig(segment_pages=4)))
    assert plan.requests() == {"only": [KeyRange(0, 10)]}  # one owner: one range, one RPC
    assert plan_lookup(keys, ShardMap([], ShardConfig(segment_pages=4))).requests() == {}


def test_bad_answers_and_configs_are_refused() -> None:
    plan = plan_lookup(chain(4), ShardMap(["a"], ShardConfig(segment_pages=2)))
    with pytest.raises(InvalidRequest):
        merge_lookup(plan, {"a": [["x"] * 5]})
    with pytest.raises(InvalidRequest):
        merge_lookup(plan, {"a": []})
    with pytest.raises(InvalidRequest):
        ShardMap(["a"], ShardConfig()).publish_targets(chain(2), [2])
    with pytest.raises(ConfigError):
        ShardConfig(segment_pages=0)
    with pytest.raises(ConfigError):
        ShardConfig(replicas=0)
