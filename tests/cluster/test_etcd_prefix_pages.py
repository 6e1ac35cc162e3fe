"""A prefix whose keys and values pass the channel's receive limit (gRPC's 4 MiB by default), read
whole on a real etcd (DESIGN §12.1, §12.4). A node's membership snapshot reads its whole root with
``get_prefix``, and every namespace ever invalidated leaves a generation record there for good: with
about 30,000 of them the one Range answer was RESOURCE_EXHAUSTED, so the snapshot and
``EtcdGenerations.read_all`` never succeeded and a node could never join or catch up. Values are
padded here to pass the limit with fewer keys."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import pytest
from aetcd import rpc
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture

from kvstore.cluster.cluster_errors import CoordinatorUnavailable
from kvstore.cluster.etcd import MAX_RECEIVE_BYTES, EtcdClient, parse_endpoints
from kvstore.cluster.generation_records import EtcdGenerations

ROOT = b"/kvstore/default/"  # the nodes' root (--cluster-name default)
PAD_BYTES = 16 * 1024  # few keys (a node enters each generation one at a time), yet a page of them fits an answer
TXN_OPS = 48  # below etcd's default --max-txn-ops (128) and, with these values, its --max-request-bytes (1.5 MiB)
NUM_BIG = MAX_RECEIVE_BYTES // PAD_BYTES + 100  # past the channel's receive limit, gRPC's 4 MiB default raised


def _generation(i: int) -> bytes:
    return json.dumps({"generation": 1 + i % 7, "issued_by": "filler", "issued_at_s": 0.0, "pad": "x" * PAD_BYTES}).encode()


def _namespace(i: int) -> bytes:
    return i.to_bytes(16, "big")


async def _fill(client: EtcdClient, items: list[tuple[bytes, bytes]]) -> None:
    for start in range(0, len(items), TXN_OPS):
        assert await client.put_if([(k, v, 0) for k, v in items[start : start + TXN_OPS]], {})


async def _fill_generations(client: EtcdClient, n: int) -> dict[bytes, int]:
    records = EtcdGenerations(client, ROOT, "filler")
    await _fill(client, [(records.prefix + _namespace(i).hex().encode(), _generation(i)) for i in range(n)])
    return {_namespace(i): 1 + i % 7 for i in range(n)}


async def test_a_prefix_past_the_receive_limit_is_read_whole(etcd) -> None:
    client = EtcdClient(parse_endpoints(etcd.url), call_timeout_s=10.0)
    try:
        items = [(b"/big/%06d" % i, b"%06d" % i + b"v" * PAD_BYTES) for i in range(NUM_BIG)]
        await _fill(client, items)
        written = await client.put(b"/bigger", b"outside the prefix")
        revision, kvs = await client.get_prefix(b"/big/")
        assert revision == written
        assert [(kv.key, kv.value) for kv in kvs] == items  # in key order, none twice, none missed
    finally:
        await client.close()


async def test_every_generation_is_read_past_the_receive_limit(etcd) -> None:
    client = EtcdClient(parse_endpoints(etcd.url), call_timeout_s=10.0)
    try:
        held = await _fill_generations(client, NUM_BIG)
        _, read = await EtcdGenerations(client, ROOT, "a").read_all()
        assert read == held
    finally:
        await client.close()


class _BetweenPages:
    """Wraps a client's Range stub: ``between`` runs after the first answer (before the next page is asked)."""

    def __init__(self, inner: Callable[..., Awaitable[object]], between: Callable[[], Awaitable[None]]) -> None:
        self._inner, self._between, self.calls = inner, between, 0

    async def __call__(self, request: object, **kwargs: object) -> object:
        answer = await self._inner(request, **kwargs)
        self.calls += 1
        if self.calls == 1:
            await self._between()
        return answer


async def test_the_pages_are_one_snapshot(etcd) -> None:
    """Keys written, changed and deleted after the first page are not in the answer: all of it is as of
    the revision it returns (the membership watch resumes from the one after)."""
    client, writer = EtcdClient(parse_endpoints(etcd.url)), EtcdClient(parse_endpoints(etcd.url))
    try:
        items = [(b"/p/%06d" % i, b"v%d" % i) for i in range(3_000)]  # small values: many pages all the same
        await _fill(client, items)
        revision = await client.put(b"/q", b"outside the prefix")

        async def write() -> None:
            await writer.put(b"/p/%06d" % 2_999, b"changed")
            await writer.delete(b"/p/%06d" % 2_998)
            await writer.put(b"/p/%06d" % 9_999, b"new")

        client._kv.Range = _BetweenPages(client._kv.Range, write)  # type: ignore[method-assign]
        got, kvs = await client.get_prefix(b"/p/")
        assert client._kv.Range.calls > 1  # type: ignore[attr-defined]  # it was read in pages
        assert got == revision
        assert [(kv.key, kv.value) for kv in kvs] == items
    finally:
        await client.close()
        await writer.close()


async def test_a_compaction_between_pages_is_coordinator_unavailable(etcd) -> None:
    """The first page's revision compacted before the next page is read: the caller retries from scratch."""
    client, writer = EtcdClient(parse_endpoints(etcd.url)), EtcdClient(parse_endpoints(etcd.url))
    try:
        items = [(b"/p/%06d" % i, b"v%d" % i) for i in range(3_000)]
        await _fill(client, items)

        async def compact() -> None:
            revision = await writer.put(b"/p/%06d" % 3_000, b"after")
            await writer._kv.Compact(rpc.CompactionRequest(revision=revision, physical=True), timeout=5.0)

        reads = client._kv.Range
        client._kv.Range = _BetweenPages(reads, compact)  # type: ignore[method-assign]
        with pytest.raises(CoordinatorUnavailable, match="compacted"):
            await client.get_prefix(b"/p/")
        client._kv.Range = reads  # type: ignore[method-assign]
        _, kvs = await client.get_prefix(b"/p/")
        assert [(kv.key, kv.value) for kv in kvs] == [*items, (b"/p/%06d" % 3_000, b"after")]
    finally:
        await client.close()
        await writer.close()


async def test_a_node_joins_past_the_receive_limit_of_generation_records(cluster_nodes, etcd) -> None:
    """A node starts (joins, catches up, serves) with that many generation records in etcd; before, its
    start timed out (``could not join the cluster``)."""
    client = EtcdClient(parse_endpoints(etcd.url), call_timeout_s=10.0)
    try:
        await _fill_generations(client, NUM_BIG)
    finally:
        await client.close()
    (a,) = cluster_nodes(["a"], "grpc", "--cluster-join-timeout-s", "60")  # a loaded machine: not 3 TTLs
    assert a.proc is not None and a.proc.poll() is None
