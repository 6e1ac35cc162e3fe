"""A peer that leaves the cluster while this node is calling it (its lease expires mid-call,
so this node closes its channel): the call ends as that peer's failure, not as the caller's."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch
from support.cluster_nodes import TTL_S, cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.errors import PageMissing

SHARDS = ShardMap(["a", "c"], ShardConfig(segment_pages=1, replicas=1))


@pytest.mark.parametrize("c_owns", [True, False], ids=["lookup-at-the-holder", "fetch-from-the-holder"])
async def test_a_holder_leaving_mid_read_is_a_miss_not_an_internal_error(cluster_nodes, c_owns: bool) -> None:
    """Bug: with a fetch deadline longer than the lease TTL, a holder frozen mid-read left the
    cluster during the read and this node closed its channel, which cancels the calls on it:
    the reader's get failed with INTERNAL (CancelledError) instead of PageMissing. Both calls
    of a read: the lookup at the holder as a shard owner (c owns the first record and a a later
    one, and the answer c cached at the client's lookup has expired: c asks a again) and the
    ReadPages fetch (a owns every record: the cached answer covers them)."""
    a, c = cluster_nodes(["a", "c"], "grpc", "--fetch-timeout-s", str(3 * TTL_S))
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(c.address, NS) as on_c:
        seed = next(s for s in range(31, 1000) if _owners(on_a.keys(tokens_of(s, 4))) == ("c" if c_owns else "a"))
        tokens = tokens_of(seed, 4)
        kv = random_kv(LAYOUT, len(tokens), seed=seed)
        assert await on_a.put(tokens, kv) == len(tokens)
        await eventually(lambda: _found(on_c, tokens), 5, "a's prefix in c's lookup")
        hit = await on_c.lookup(tokens)
        if c_owns:
            await asyncio.sleep(TTL_S + 0.5)  # the answers c cached (kept the membership TTL) expire: the read asks a
        a.freeze()  # every thread stopped: a SIGSTOP only queued, a ReadPages sent now was still answered under load
        try:
            started = time.monotonic()
            with pytest.raises(PageMissing) as missing:
                await on_c.get(hit, torch.zeros_like(kv))
            assert missing.value.num_tokens == 0  # type: ignore[attr-defined]
            assert time.monotonic() - started < 3 * TTL_S + 2
            stats = await on_c._call(on_c.runtime.directory.Stats, directory_pb2.StatsRequest())
            assert stats.num_leases == 0 and next(t for t in stats.tiers if t.tier == "host").num_pages == 0
            asked = "lookup at owner a " in c.log.read_text()  # ended with its channel, or failed at its deadline
            assert asked == c_owns, "the read asked frozen a for records" if asked else "the read did not ask a for records"
        finally:
            a.signal(signal.SIGCONT)


def _owners(keys: list[bytes]) -> str:
    """"c" when c owns the first record and a a later one, "a" when a owns every record, else ""."""
    owners = [SHARDS.owners(k)[0] for k in keys]
    return "c" if owners[0] == "c" and "a" in owners[1:] else "a" if set(owners) == {"a"} else ""


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)
