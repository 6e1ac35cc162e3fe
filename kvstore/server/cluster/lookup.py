"""A prefix lookup across the cluster: this node's directory first, then one parallel round
to the owners of the rest (``Lookup`` with ``local_only``), merged to the contiguous prefix.

Owners are per page: a record lives with the rendezvous owners of the page's own key (a
``ShardMap`` of one-page segments). DESIGN §12 names segments by the chain's key at depth
S·k, but a holder cannot compute that: a page key carries no depth, and neither the
allocation nor the SSD index records one, so a node republishing its SSD pages after a
restart could not find their segments. Per-page owners keep the round to one call per live
owner (at most N calls, however long the prefix).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from itertools import groupby

from kvstore._proto import directory_pb2
from kvstore.cluster.shards import KeyRange, LookupPlan, ShardMap, merge_lookup, plan_lookup
from kvstore.directory import Directory
from kvstore.errors import InvalidRequest
from kvstore.server.cluster.peers import Peers, current_cancelled
from kvstore.types import LocationRun

logger = logging.getLogger(__name__)

PageRecord = tuple[str, str, int]  # (node, tier, size_bytes) of one page's best copy


def expand(runs: Sequence[LocationRun]) -> list[PageRecord]:
    return [(r.node, r.tier, r.size_bytes) for r in runs for _ in range(r.num_pages)]


def compress(records: Sequence[PageRecord]) -> list[LocationRun]:
    # groupby runs in C: one LocationRun per run, not one per page
    return [LocationRun(node, tier, sum(1 for _ in same), size) for (node, tier, size), same in groupby(records)]


def split(records: list[PageRecord], ranges: list[KeyRange]) -> list[list[PageRecord]]:
    """The records of a leading prefix of the ranges' pages (concatenated), per range."""
    out, at = [], 0
    for rng in ranges:
        out.append(records[at : at + rng.stop - rng.start])
        at += rng.stop - rng.start
    return out


class AnswerCache:
    """Records a lookup learned from other owners, kept ``ttl_s`` (the membership TTL: as long
    as a dead node's records may be listed anyway), so that the Acquire that follows a
    client's lookup fetches without asking the owners again, and still fetches when an owner
    fails between the two. A stale record costs a miss (the holder answers MISSING). Kept per
    tenant asked for: the owners answered that tenant, and no other may fetch on its answer; and
    per namespace generation asked in: once the namespace entered a newer one its holders dropped
    those pages, and a record read then sent every fill to a MISSING for the whole TTL. A fill
    whose holder had none of them forgets them (``forget``) and asks the owners again.
    Bounded: a put past ``PURGE_AT`` entries purges the expired ones, past ``MAX_ENTRIES`` all."""

    MAX_ENTRIES = 1 << 16
    PURGE_AT = 1 << 10  # entries past which the expired ones go (then again once twice as many are live)

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._records: dict[tuple[bytes, str], tuple[bytes, PageRecord, float, int]] = {}
        self._purge_at = self.PURGE_AT

    def put(self, namespace_id: bytes, keys: Sequence[bytes], records: Sequence[PageRecord], tenant: str = "",
            generation: int = 0) -> None:
        now = self._clock()
        if len(self._records) + len(records) > self._purge_at:  # expired records are never read again
            self._records = {k: v for k, v in self._records.items() if v[2] >= now}
            self._purge_at = max(self.PURGE_AT, 2 * len(self._records))
        if len(self._records) + len(records) > self.MAX_ENTRIES:
            self._records.clear()
        expires = now + self._ttl_s
        self._records.update(((key, tenant), (namespace_id, record, expires, generation)) for key, record in zip(keys, records))

    def leading(self, namespace_id: bytes, keys: Sequence[bytes], tenant: str = "", generation: int = 0) -> list[PageRecord]:
        """The cached records of the leading ``keys`` learned in ``generation`` (stops at the first not cached)."""
        now, out = self._clock(), []
        for key in keys:
            cached = self._records.get((key, tenant))
            if cached is None or cached[0] != namespace_id or cached[2] < now or cached[3] != generation:
                break
            out.append(cached[1])
        return out

    def forget(self, keys: Sequence[bytes], tenant: str = "") -> None:
        """Drops the records of ``keys`` (a holder they named answered it has none)."""
        for key in keys:
            self._records.pop((key, tenant), None)

    def forget_node(self, node: str) -> None:
        self._records = {k: v for k, v in self._records.items() if v[1][0] != node}


class PlanCache:
    """The lookup plans of the chains looked up lately, per shard map: planning a 512-page
    chain (an owner per page, its ranges, the keys asked of each owner) costs ~0.5 ms of
    Python, most of a lookup's own CPU, and the hot chains (shared system prompts) are looked
    up again and again. A new shard map (membership change) starts afresh. Loop-only."""

    MAX_PLANS = 256

    def __init__(self) -> None:
        self._map: ShardMap | None = None
        self._plans: dict[tuple[bytes, ...], tuple[LookupPlan, dict[str, list[bytes]]]] = {}

    def get(self, keys: list[bytes], shard_map: ShardMap) -> tuple[LookupPlan, dict[str, list[bytes]]]:
        """The plan of ``keys`` under ``shard_map`` and, per owner asked, the keys to ask it for."""
        if shard_map is not self._map:
            self._map, self._plans = shard_map, {}
        chain = tuple(keys)
        found = self._plans.get(chain)
        if found is None:
            found = plan_and_keys(plan_lookup(chain, shard_map))
            if len(self._plans) >= self.MAX_PLANS:
                del self._plans[next(iter(self._plans))]  # the oldest planned
            self._plans[chain] = found
        return found


def plan_and_keys(plan: LookupPlan) -> tuple[LookupPlan, dict[str, list[bytes]]]:
    keys = plan.keys
    return plan, {owner: [k for rng in ranges for k in keys[rng.start : rng.stop]] for owner, ranges in plan.requests().items()}


class ShardedLookup:
    """Owners answer with the namespace's generation where they are: an answer of another
    generation than this node's is discarded (an owner behind this node would promise pages
    of an older one; one ahead tells this node it is behind: ``newer`` enters it here)."""

    def __init__(self, directory: Directory, node: str, peers: Peers, shard_map: Callable[[], ShardMap],
                 timeout_s: float, cache_ttl_s: float, newer: Callable[[bytes, int], None] = lambda ns, g: None) -> None:
        self._directory = directory
        self._newer = newer
        self._node = node
        self._peers = peers
        self._shard_map = shard_map
        self._timeout_s = timeout_s
        self.cache = AnswerCache(cache_ttl_s)
        self._plans = PlanCache()

    async def lookup(self, namespace_id: bytes, keys: list[bytes], timeout_s: float | None = None,
                     tenant: str = "") -> list[LocationRun]:
        """``tenant``: the caller's, named to the owners (they answer only for its namespaces)."""
        generation = self._directory.generation(namespace_id)  # what the owners answer is where pages are in it
        local = self._directory.lookup(namespace_id, keys)
        found = sum(r.num_pages for r in local)
        if found == len(keys):
            return local
        rest = keys[found:]
        timeout = min(self._timeout_s, timeout_s) if timeout_s else self._timeout_s
        shard_map, failed = self._shard_map(), set[str]()
        # one round; a second only when an owner failed and the records have other replicas
        for _ in range(2 if shard_map.config.replicas > 1 else 1):
            plan, asked = self._plans.get(rest, shard_map) if not failed else plan_and_keys(plan_lookup(rest, shard_map, exclude=failed))
            requests = plan.requests()
            owners = list(requests)
            answers = await asyncio.gather(*(self._ask(o, namespace_id, asked[o], requests[o], timeout, tenant) for o in owners))
            try:
                merged = merge_lookup(plan, dict(zip(owners, answers)))
            except InvalidRequest as exc:  # an owner answered more than it was asked: trust none of it
                logger.warning("discarding a malformed lookup answer: %s", exc)
                return local
            failed |= {o for o, a in zip(owners, answers) if a is None}
            if len(merged) == len(rest) or not failed:
                break
        self.cache.put(namespace_id, rest, merged, tenant, generation)
        return compress(expand(local) + merged)

    async def records(self, namespace_id: bytes, keys: list[bytes], timeout_s: float, tenant: str = "") -> list[PageRecord]:
        """Per leading page of ``keys``, where it is: this node's records (its own as an owner),
        then cached answers, then a lookup. The cache holds what other owners answered after the
        local part (``lookup``): read from the first key, it missed wherever this node owns the
        first pages, and the fetch asked every owner again (a frozen one cost its whole deadline)."""
        found = expand(self._directory.lookup(namespace_id, keys))
        found += self.cache.leading(namespace_id, keys[len(found):], tenant, self._directory.generation(namespace_id))
        if len(found) < len(keys):
            found += expand(await self.lookup(namespace_id, keys[len(found):], timeout_s, tenant))
        return found

    async def _ask(self, owner: str, namespace_id: bytes, asked: list[bytes], ranges: list[KeyRange],
                   timeout_s: float, tenant: str) -> list[list[PageRecord]] | None:
        """One owner's records for its ranges (``asked``: their keys, in order); None when it did not answer."""
        if owner == self._node:
            return split(expand(self._directory.lookup(namespace_id, asked)), ranges)
        peer = self._peers.get(owner)
        if peer is None:
            return None
        generation = self._directory.generation(namespace_id)
        try:
            resp = await peer.directory.Lookup(directory_pb2.LookupRequest(namespace_id=namespace_id, keys=asked, local_only=True,
                                                                               tenant=tenant),
                                               timeout=timeout_s)
        except asyncio.CancelledError:
            if current_cancelled():
                raise
            logger.info("lookup at owner %s ended with its channel (it left the cluster)", owner)
            return None
        except Exception as exc:  # noqa: BLE001 - any failure of the owner ends the prefix at its first page
            logger.info("lookup at owner %s failed: %r", owner, exc)
            return None
        if resp.generation != generation:
            if resp.generation > generation:
                self._newer(namespace_id, resp.generation)
            return [[] for _ in ranges]  # nothing of another generation is promised
        runs = [LocationRun(r.node, r.tier, r.num_pages, r.size_bytes) for r in resp.runs]
        return split(expand(runs)[: len(asked)], ranges)
