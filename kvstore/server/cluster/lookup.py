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
from collections.abc import Callable, Sequence

from kvstore._proto import directory_pb2
from kvstore.cluster.shards import KeyRange, ShardMap, merge_lookup, plan_lookup
from kvstore.directory import Directory
from kvstore.errors import InvalidRequest
from kvstore.server.cluster.peers import Peers
from kvstore.types import LocationRun

logger = logging.getLogger(__name__)

PageRecord = tuple[str, str, int]  # (node, tier, size_bytes) of one page's best copy


def expand(runs: Sequence[LocationRun]) -> list[PageRecord]:
    return [(r.node, r.tier, r.size_bytes) for r in runs for _ in range(r.num_pages)]


def compress(records: Sequence[PageRecord]) -> list[LocationRun]:
    runs: list[LocationRun] = []
    for node, tier, size in records:
        last = runs[-1] if runs else None
        if last is not None and (last.node, last.tier, last.size_bytes) == (node, tier, size):
            runs[-1] = LocationRun(node, tier, last.num_pages + 1, size)
        else:
            runs.append(LocationRun(node, tier, 1, size))
    return runs


def split(records: list[PageRecord], ranges: list[KeyRange]) -> list[list[PageRecord]]:
    """The records of a leading prefix of the ranges' pages (concatenated), per range."""
    out, at = [], 0
    for rng in ranges:
        out.append(records[at : at + rng.stop - rng.start])
        at += rng.stop - rng.start
    return out


class ShardedLookup:
    def __init__(self, directory: Directory, node: str, peers: Peers, shard_map: Callable[[], ShardMap],
                 timeout_s: float) -> None:
        self._directory = directory
        self._node = node
        self._peers = peers
        self._shard_map = shard_map
        self._timeout_s = timeout_s

    async def lookup(self, namespace_id: bytes, keys: list[bytes], timeout_s: float | None = None) -> list[LocationRun]:
        local = self._directory.lookup(namespace_id, keys)
        found = sum(r.num_pages for r in local)
        if found == len(keys):
            return local
        rest = keys[found:]
        plan = plan_lookup(rest, self._shard_map())
        requests = plan.requests()
        timeout = min(self._timeout_s, timeout_s) if timeout_s else self._timeout_s
        owners = list(requests)
        answers = await asyncio.gather(*(self._ask(o, namespace_id, rest, requests[o], timeout) for o in owners))
        try:
            merged = merge_lookup(plan, dict(zip(owners, answers)))
        except InvalidRequest as exc:  # an owner answered more than it was asked: trust none of it
            logger.warning("discarding a malformed lookup answer: %s", exc)
            return local
        return compress(expand(local) + merged)

    async def _ask(self, owner: str, namespace_id: bytes, keys: list[bytes], ranges: list[KeyRange],
                   timeout_s: float) -> list[list[PageRecord]] | None:
        """One owner's records for its ranges; None when it did not answer."""
        asked = [k for rng in ranges for k in keys[rng.start : rng.stop]]
        if owner == self._node:
            return split(expand(self._directory.lookup(namespace_id, asked)), ranges)
        peer = self._peers.get(owner)
        if peer is None:
            return None
        try:
            resp = await peer.directory.Lookup(directory_pb2.LookupRequest(namespace_id=namespace_id, keys=asked, local_only=True),
                                               timeout=timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the owner ends the prefix at its first page
            logger.info("lookup at owner %s failed: %r", owner, exc)
            return None
        runs = [LocationRun(r.node, r.tier, r.num_pages, r.size_bytes) for r in resp.runs]
        return split(expand(runs)[: len(asked)], ranges)
