"""Entering many namespace generations at once (DESIGN §12.5: a node catching up with etcd enters every
generation it holds): one synced LMDB transaction for the lot, with every guarantee of entering one.
Before, each namespace took a synced transaction of its own (about 0.9 ms each), so a node joining a
cluster of 30,000 invalidated namespaces spent ~27 s entering them, its keep-alives late."""

from __future__ import annotations

from typing import Any

import torch
from support.kv import random_kv

from kvstore import Namespace
from kvstore.client import KVStoreClient
from kvstore.directory.events import EventKind
from kvstore.types import REMOTE_TIER

NUM_EMPTY = 2_000  # namespaces with nothing here (a fresh node's whole catch-up)


class _CountedEnv:
    """The directory's LMDB environment, counting write transactions and syncs."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.writes, self.syncs = inner, 0, 0

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        self.writes += bool(kwargs.get("write"))
        return self._inner.begin(*args, **kwargs)

    def sync(self, *args: Any) -> None:
        self.syncs += 1
        self._inner.sync(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _empty(i: int) -> bytes:
    return (1 << 100 | i).to_bytes(16, "big")


async def test_many_generations_are_entered_in_one_transaction_and_drop_what_they_invalidate(server_factory, layout,
                                                                                            ns) -> None:
    server = server_factory()
    other = Namespace(model="other", revision="r1", layout=layout)
    kept = Namespace(model="kept", revision="r1", layout=layout)
    tokens = list(range(3 * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=4)
    async with KVStoreClient(server.address, ns) as a, KVStoreClient(server.address, other) as b, \
            KVStoreClient(server.address, kept) as c:
        for client in (a, b, c):
            assert await client.put(tokens, kv) == len(tokens)
        assert await b.invalidate() == 1  # other at generation 1: entering 1 again changes nothing
        assert await b.put(tokens, kv, generation=1) == len(tokens)
    core, directory = server.core, server.core.directory
    remote_key = b"r" * 16
    core.publish_remote(ns.namespace_id, [(remote_key, "elsewhere", REMOTE_TIER, 4096)])  # a durable row
    landing_before = core.landing.usage().used_bytes
    raised = {ns.namespace_id: 3, other.namespace_id: 1} | {_empty(i): 1 + i % 4 for i in range(NUM_EMPTY)}
    counted = _CountedEnv(directory.env)
    directory.env = counted
    seq = directory.events.last_seq
    try:
        removed = core.enter_generations(raised)
    finally:
        directory.env = counted._inner
    assert counted.syncs <= 1 and counted.writes <= 2, f"{counted.writes} write transactions, {counted.syncs} syncs"
    assert removed == {ns.namespace_id: 4} | {_empty(i): 0 for i in range(NUM_EMPTY)}  # 3 pages + the remote record
    assert {e.namespace_id for e in directory.events.since(seq + 1) if e.kind is EventKind.CLEARED} == \
        set(raised) - {other.namespace_id}
    assert directory.get(remote_key) is None
    assert core.landing.usage().used_bytes < landing_before  # the landing copies of ns went
    assert core.enter_generations({ns.namespace_id: 2, _empty(0): 0}) == {}  # never backwards
    async with KVStoreClient(server.address, ns) as a, KVStoreClient(server.address, other) as b, \
            KVStoreClient(server.address, kept) as c:
        assert (hit := await a.lookup(tokens)).num_tokens == 0 and hit.generation == 3
        for client, generation in ((b, 1), (c, 0)):
            out = torch.zeros_like(kv)
            hit = await client.lookup(tokens)
            assert hit.generation == generation and await client.get(hit, out) == len(tokens) and torch.equal(out, kv)
    config = server.config
    server.stop()
    again = server_factory(config)
    held = again.core.directory.generations()
    assert held == {ns.namespace_id: 3, other.namespace_id: 1} | {_empty(i): 1 + i % 4 for i in range(NUM_EMPTY)}
    assert again.core.directory.get(remote_key) is None
