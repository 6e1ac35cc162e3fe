"""The client's I/O runtime: closing while a put or a get is in flight (the call completes
once, no copy runs after it, nothing is left leased and no slot allocated that is not
published), and engine calls run synchronously through ``runtime.run``."""

from __future__ import annotations

import asyncio
import gc
import threading

import grpc
import pytest
import torch
from support.kv import random_kv

from kvstore import KVLayout
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.client.engine_kv import ContiguousKV
from kvstore.errors import KVStoreError


class GatedKV:
    """The engine's KV behind a gate: the first copy that touches it signals ``reached`` and
    every copy waits for ``gate`` (the engine is busy); ``copies`` counts the layer copies."""

    def __init__(self, kv: torch.Tensor, layout: KVLayout) -> None:
        self.inner = ContiguousKV(kv, layout)
        self.num_tokens = kv.shape[2]
        self.reached, self.gate = threading.Event(), threading.Event()
        self.copies = 0

    def _pass(self) -> None:
        self.reached.set()
        assert self.gate.wait(30), "the gate was never opened"
        self.copies += 1

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        self._pass()
        return self.inner.read_layer(page, layer)

    def write_layer(self, page: int, layer: int, src: torch.Tensor) -> None:
        self._pass()
        self.inner.write_layer(page, layer, src)


async def _stats(address: str) -> directory_pb2.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10)


def _host_bytes(stats: directory_pb2.StatsResponse) -> int:
    return next(t.used_bytes for t in stats.tiers if t.tier == "host")


async def _close_at_the_gate(client: KVStoreClient, engine: GatedKV, call: asyncio.Task[int]) -> None:
    """Closes ``client`` once ``call`` is inside a copy, then lets the copies go on."""
    assert await asyncio.get_running_loop().run_in_executor(None, engine.reached.wait, 30)
    closing = asyncio.create_task(client.close())
    await asyncio.sleep(0)  # close starts: it cancels the call in flight
    engine.gate.set()
    await asyncio.wait_for(closing, 30)
    done, _ = await asyncio.wait([call], timeout=30)
    assert done, "the call did not complete"


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_closing_mid_put_leaves_no_slot_unpublished(server, layout, ns, use_shm) -> None:
    """Closing the client while a put copies its first pages (the old client closed the channel
    under the put: 24 allocated slots stayed held, found by no lookup, until they expired):
    every slot the put took is published or given back when close returns."""
    tokens = list(range(16 * 300))
    engine = GatedKV(random_kv(layout, len(tokens), seed=51), layout)
    before = _host_bytes(await _stats(server.address))
    client = KVStoreClient(server.address, ns, use_shm=use_shm)
    await client.connect()
    put = asyncio.create_task(client.put(tokens, engine))
    await _close_at_the_gate(client, engine, put)
    async with grpc.aio.insecure_channel(server.address) as channel:
        directory = directory_pb2_grpc.DirectoryStub(channel)
        published = 0
        for key in client.keys(tokens):  # page by page: the published pages need not be a prefix
            answer = await directory.Lookup(directory_pb2.LookupRequest(namespace_id=ns.namespace_id, keys=[key]), timeout=10)
            published += answer.num_pages
    stats = await _stats(server.address)
    assert _host_bytes(stats) - before == published * layout.page_bytes, "slots are held that no lookup finds"
    assert stats.num_leases == 0


async def test_closing_mid_get_leaves_nothing_leased_and_copies_nothing_after(server, layout, ns) -> None:
    """Closing the client while a get copies out of leased slots into a busy engine (the old
    client's close shut its copy threads down from the caller's event loop and hung there
    until the copy gave up; its channel was closed under the get's releases): when close
    returns nothing is leased, the get has completed once, and no copy into the engine follows."""
    tokens = list(range(16 * 300))
    async with KVStoreClient(server.address, ns) as writer:
        assert await writer.put(tokens, random_kv(layout, len(tokens), seed=52)) == len(tokens)
    client = KVStoreClient(server.address, ns)
    await client.connect()
    hit = await client.lookup(tokens)
    engine = GatedKV(torch.zeros(layout.num_layers, layout.kv_factor, len(tokens), layout.num_kv_heads, layout.head_dim,
                                 dtype=layout.torch_dtype()), layout)
    get = asyncio.create_task(client.get(hit, into=engine))
    await _close_at_the_gate(client, engine, get)
    copies = engine.copies
    with pytest.raises(KVStoreError):
        get.result()
    assert (await _stats(server.address)).num_leases == 0, "the get left leases behind"
    await asyncio.sleep(0.2)  # any copy still running would land here
    assert engine.copies == copies, "a copy ran after close returned"


async def test_a_cancelled_get_returns_only_after_its_copies(server, layout, ns, caplog) -> None:
    """A caller that gives up on a get (wait_for, task.cancel) while its copies wait on a busy
    engine (the old client's cancel cut the Acquire in flight: its lease stayed until the ttl;
    and it did not wait for the copies): the cancelled call returns once the copies are done
    and every lease is back. What the cancelled job ended with is read, not left for asyncio to
    log as "Future exception was never retrieved" (an ERROR line in every engine's log)."""
    tokens = list(range(16 * 100))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens), seed=54)) == len(tokens)
        hit = await client.lookup(tokens)
        engine = GatedKV(torch.zeros(layout.num_layers, layout.kv_factor, len(tokens), layout.num_kv_heads,
                                     layout.head_dim, dtype=layout.torch_dtype()), layout)
        get = asyncio.create_task(client.get(hit, into=engine))
        assert await asyncio.get_running_loop().run_in_executor(None, engine.reached.wait, 30)
        get.cancel()
        engine.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await get
        copies = engine.copies
        assert (await _stats(server.address)).num_leases == 0, "the cancelled get left leases behind"
        await asyncio.sleep(0.2)  # any copy still running would land here
        assert engine.copies == copies, "a copy ran after the cancelled get returned"
        assert (await client.lookup(tokens)).num_tokens == len(tokens), "the client works on after a cancel"
    gc.collect()  # an unretrieved future's exception is logged when it is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_engine_keys_and_a_synchronous_hook(server, layout, ns, use_shm) -> None:
    """put_keys stores page i under keys[i] of a chain the engine computed itself, and
    lookup_keys finds its prefix; a synchronous engine hook runs the same calls through
    ``runtime.run`` even from the thread of a blocked event loop; after close every call
    raises a clear KVStoreError."""
    keys = [bytes([i]) * 16 for i in range(1, 7)]
    kv = random_kv(layout, 6 * layout.page_tokens, seed=53)
    client = KVStoreClient(server.address, ns, use_shm=use_shm)
    await client.connect()
    assert await client.put_keys(keys[:4], kv[:, :, : 4 * layout.page_tokens]) == 4 * layout.page_tokens
    hit = client.runtime.run(client.lookup_keys(keys), 10)  # this loop is blocked meanwhile
    assert hit.keys == keys[:4] and hit.num_tokens == 4 * layout.page_tokens
    out = torch.zeros_like(kv)
    assert client.runtime.run(client.get(hit, into=out), 10) == 4 * layout.page_tokens
    assert torch.equal(out[:, :, : 4 * layout.page_tokens], kv[:, :, : 4 * layout.page_tokens])
    assert (await client.lookup(list(range(64)))).num_tokens == 0, "engine keys are not the token chain's"
    await client.close()
    with pytest.raises(KVStoreError, match="closed"):
        await client.lookup_keys(keys)
    with pytest.raises(KVStoreError, match="closed"):
        client.runtime.run(client.lookup_keys(keys), 10)
