"""The sharded, soft directory's arithmetic: which members own which chain segment, what moves
when membership changes, and a prefix lookup as one parallel round (DESIGN §12).

More: kvstore/cluster/README.md (### shards.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, TypeVar, cast

import xxhash

from kvstore.errors import ConfigError, InvalidRequest

T = TypeVar("T")


@dataclass(frozen=True)
class ShardConfig:
    segment_pages: int = 64  # 1,024 tokens of 16-token pages
    replicas: int = 1        # owners per segment (R); lookups ask one, publishes go to all

    def __post_init__(self) -> None:
        if self.segment_pages < 1:
            raise ConfigError("--cluster-segment-pages must be >= 1")
        if self.replicas < 1:
            raise ConfigError("--cluster-replicas must be >= 1")


class Segment(NamedTuple):
    """Pages ``[start, stop)`` of one chain; ``key`` is the chain's key at ``start``.
    (A tuple: a lookup of a long chain of one-page segments makes one per page.)"""

    index: int
    start: int
    stop: int
    key: bytes


def score(node_id: str, segment_key: bytes) -> int:
    """The rendezvous weight of a node for a segment (higher wins)."""
    return xxhash.xxh3_64_intdigest(node_id.encode() + b"\0" + segment_key)


def segments(keys: Sequence[bytes], segment_pages: int) -> list[Segment]:
    """The segments of a chain's first ``len(keys)`` pages (the last one may be short)."""
    return [Segment(i, start, min(start + segment_pages, len(keys)), keys[start])
            for i, start in enumerate(range(0, len(keys), segment_pages))]


def segment_start(page_index: int, segment_pages: int) -> int:
    """Depth of the first page of the segment holding ``page_index``: its key names the segment."""
    if page_index < 0:
        raise InvalidRequest(f"page index must be >= 0, got {page_index}")
    return page_index - page_index % segment_pages


class ShardMap:
    """Segment owners over one member set. Immutable: a membership change makes a new map."""

    _CACHE_ENTRIES = 1 << 16  # hot segments (system prompts) are asked again and again

    def __init__(self, members: Iterable[str], config: ShardConfig) -> None:
        self.members = tuple(sorted(set(members)))
        self.config = config
        self._owners: dict[bytes, tuple[str, ...]] = {}

    def owners(self, segment_key: bytes) -> tuple[str, ...]:
        """The segment's owners, best first (at most ``replicas``; none when no member is live)."""
        owners = self._owners.get(segment_key)
        if owners is None:
            owners = tuple(heapq.nlargest(self.config.replicas, self.members, key=lambda node: (score(node, segment_key), node)))
            if len(self._owners) >= self._CACHE_ENTRIES:
                self._owners.clear()
            self._owners[segment_key] = owners
        return owners

    def publish_targets(self, keys: Sequence[bytes], indices: Iterable[int]) -> dict[str, list[int]]:
        """For pages ``indices`` of the chain ``keys`` that a node holds: owner -> the page
        indices whose records it must receive (every replica gets each record)."""
        by_segment: dict[int, list[int]] = {}
        for i in indices:
            if not 0 <= i < len(keys):
                raise InvalidRequest(f"page index {i} is outside the chain of {len(keys)} keys")
            by_segment.setdefault(segment_start(i, self.config.segment_pages), []).append(i)
        targets: dict[str, list[int]] = {}
        for start, pages in sorted(by_segment.items()):
            for owner in self.owners(keys[start]):
                targets.setdefault(owner, []).extend(pages)
        return targets


@dataclass(frozen=True)
class Move:
    """A segment whose owner set changed: holders republish its records to ``gained``;
    ``lost`` owners may drop them."""

    segment_key: bytes
    before: tuple[str, ...]
    after: tuple[str, ...]

    @property
    def gained(self) -> tuple[str, ...]:
        return tuple(o for o in self.after if o not in self.before)

    @property
    def lost(self) -> tuple[str, ...]:
        return tuple(o for o in self.before if o not in self.after)


def moves(segment_keys: Iterable[bytes], before: ShardMap, after: ShardMap) -> list[Move]:
    """The segments among ``segment_keys`` whose owner set differs between two maps (order
    within the replicas does not count: it changes who is asked first, not who holds)."""
    out = []
    for key in segment_keys:
        b, a = before.owners(key), after.owners(key)
        if set(b) != set(a):
            out.append(Move(key, b, a))
    return out


class KeyRange(NamedTuple):
    """Pages ``[start, stop)`` of the looked-up chain (a tuple, as ``Segment``)."""

    start: int
    stop: int


@dataclass(frozen=True)
class LookupPlan:
    """One lookup as one parallel round: ``asked[i]`` is the owner asked for ``segments[i]``
    (None: no live owner, the prefix ends there)."""

    keys: tuple[bytes, ...]
    segments: tuple[Segment, ...]
    asked: tuple[str | None, ...]

    def requests(self) -> dict[str, list[KeyRange]]:
        """Owner -> the page ranges to ask it for, in chain order: one RPC per owner.
        Computed once per plan (the lookup and its merge both read it): do not mutate."""
        return self._requests

    @cached_property
    def _requests(self) -> dict[str, list[KeyRange]]:
        spans: dict[str, list[list[int]]] = {}  # [start, stop] grown in place; a KeyRange per final range
        for seg, owner in zip(self.segments, self.asked):
            if owner is None:
                continue
            ranges = spans.setdefault(owner, [])
            if ranges and ranges[-1][1] == seg.start:
                ranges[-1][1] = seg.stop  # adjacent segments of one owner: one range
            else:
                ranges.append([seg.start, seg.stop])
        return {owner: [KeyRange(start, stop) for start, stop in ranges] for owner, ranges in spans.items()}


def plan_lookup(keys: Sequence[bytes], shard_map: ShardMap,
                choose: Callable[[Segment, tuple[str, ...]], str] | None = None,
                exclude: Iterable[str] = ()) -> LookupPlan:
    """Plans the lookup of a chain. ``choose`` picks one of a segment's owners (default: the
    best; a caller spreads hot segments by choosing among replicas); owners in ``exclude``
    (failed in an earlier round) are skipped."""
    excluded = set(exclude)
    segs = segments(keys, shard_map.config.segment_pages)
    asked: list[str | None] = []
    for seg in segs:
        owners = shard_map.owners(seg.key)
        if excluded:
            owners = tuple(o for o in owners if o not in excluded)
        asked.append(None if not owners else choose(seg, owners) if choose else owners[0])
    return LookupPlan(tuple(keys), tuple(segs), tuple(asked))


def merge_lookup(plan: LookupPlan, answers: Mapping[str, Sequence[Sequence[T | None]] | None]) -> list[T]:
    """The records of the contiguous prefix found. ``answers[owner]`` holds, per range of
    ``plan.requests()[owner]`` in order, the records of that range's pages (None or a short
    list: not held); an owner missing from ``answers`` or answering None failed, and the
    prefix ends at its first segment. A malformed answer (wrong number of ranges, a range
    longer than asked) raises InvalidRequest rather than being trusted."""
    requests = plan.requests()
    by_page: list[T | None] = [None] * len(plan.keys)
    failed: set[str] = set()
    for asked_owner, ranges in requests.items():
        answer = answers.get(asked_owner)
        if answer is None:
            failed.add(asked_owner)
            continue
        if len(answer) != len(ranges):
            raise InvalidRequest(f"owner {asked_owner} answered {len(answer)} ranges, {len(ranges)} were asked")
        for rng, records in zip(ranges, answer):
            if len(records) > rng.stop - rng.start:
                raise InvalidRequest(f"owner {asked_owner} answered {len(records)} records for {rng.stop - rng.start} pages")
            by_page[rng.start : rng.start + len(records)] = records
    end = len(plan.keys)  # the first page of the first segment without an owner that answered
    for seg, owner in zip(plan.segments, plan.asked):
        if owner is None or owner in failed:
            end = seg.start
            break
    try:  # the prefix ends at the first page no owner listed (list.index: one pass in C)
        end = by_page.index(None, 0, end)
    except ValueError:
        pass
    return cast(list[T], by_page[:end])
