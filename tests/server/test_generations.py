"""Namespace generations on one node (DESIGN §12.4): a write computed before an invalidation is
refused after it and leaves nothing behind; a crash between raising a generation and deleting
the older pages never serves them after the restart; SSD pages written before format 2 stay
readable as generation 0."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import grpc
import lmdb
import pytest
import torch
from support.kv import random_kv

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import StaleGeneration
from kvstore.page import LayoutDesc, checksum
from kvstore.validate import layout_msg


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "stream"])
async def test_a_put_naming_a_generation_an_invalidation_left_is_refused(server, layout, ns, use_shm: bool) -> None:
    tokens = list(range(3 * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=1)
    async with KVStoreClient(server.address, ns, use_shm=use_shm) as client:
        hit = await client.lookup(tokens)
        assert hit.generation == 0
        assert await client.invalidate() == 1
        with pytest.raises(StaleGeneration, match="generation 1; the call names an older one"):
            await client.put(tokens, kv, generation=hit.generation)
        assert (await client.lookup(tokens)).num_tokens == 0
        assert server.core.leases.counts().num_allocations == 0, "a refused put left an allocation"
        assert await client.put(tokens, kv, generation=1) == len(tokens)
        out = torch.zeros_like(kv)
        hit = await client.lookup(tokens)
        assert hit.generation == 1 and await client.get(hit, out) == len(tokens) and torch.equal(out, kv)


def test_a_commit_after_an_invalidation_is_refused_and_frees_its_slots(server, layout, ns) -> None:
    """A hostile or late writer: its allocation was made in generation 0, the namespace was
    invalidated meanwhile: FAILED_PRECONDITION naming the current generation, nothing stored."""
    keys = [bytes([i]) * 16 for i in range(2)]
    lay = layout_msg(LayoutDesc.of(layout))
    with grpc.insecure_channel(server.address) as channel:
        data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
        alloc = data.Allocate(data_pb2.AllocateRequest(namespace_id=ns.namespace_id, layout=lay, keys=keys), timeout=5)
        assert alloc.generation == 0
        directory.Invalidate(directory_pb2.InvalidateRequest(namespace_id=ns.namespace_id), timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            data.Commit(data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=keys, checksums=[0, 0]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "is at generation 1" in refused.value.details()
        with pytest.raises(grpc.RpcError) as stale:
            data.Allocate(data_pb2.AllocateRequest(namespace_id=ns.namespace_id, layout=lay, keys=keys, generation=0), timeout=5)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert server.core.leases.counts().num_allocations == 0
    assert server.core.landing.usage().used_bytes == 0, "a refused commit kept its slots"


async def test_pages_of_a_generation_raised_before_a_crash_are_never_served_after_it(server_factory, tmp_path,
                                                                                    layout, ns) -> None:
    """A crash between writing the raised generation and deleting the older pages: the SSD
    still holds them, and recovery deletes them instead of listing them."""
    server = server_factory()
    tokens = list(range(4 * layout.page_tokens))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens), seed=2), durable=True) == len(tokens)
    assert server.core.directory.persist_generation(ns.namespace_id, 5)  # the raise's first, durable step only
    config = server.config
    server.stop()
    again = server_factory(config)
    assert again.core.directory.generation(ns.namespace_id) == 5
    async with KVStoreClient(again.address, ns) as client:
        assert (await client.lookup(tokens)).num_tokens == 0
    assert again.core.lower[0].usage().num_pages == 0, "the older generation's pages are still on the SSD"


async def test_pages_newer_than_the_generation_table_raise_it_at_recovery(server_factory, layout, ns) -> None:
    """The table's raise lost to an OS crash while the newer pages it let in were kept (found
    by a review of 462107e: recovery deleted every page whose generation was not the table's,
    so acknowledged durable pages of the newer generation went). Recovery raises the table."""
    server = server_factory()
    tokens = list(range(2 * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=3)
    async with KVStoreClient(server.address, ns) as client:
        for _ in range(3):
            await client.invalidate()
        assert await client.put(tokens, kv, durable=True, generation=3) == len(tokens)
    config = server.config
    server.stop()
    env = lmdb.open(str(config.data_dir / "directory.lmdb"), max_dbs=6, subdir=True)
    with env.begin(write=True) as txn:  # the table as an undone raise left it
        txn.put(ns.namespace_id, b"0", db=env.open_db(b"generations", txn=txn))
    env.close()
    again = server_factory(config)
    assert again.core.directory.generation(ns.namespace_id) == 3
    async with KVStoreClient(again.address, ns) as client:
        out = torch.zeros_like(kv)
        hit = await client.lookup(tokens)
        assert hit.generation == 3 and await client.get(hit, out) == len(tokens) and torch.equal(out, kv)


def test_a_stream_naming_no_generation_cut_by_an_invalidation_is_told_what_happened(server, layout, ns) -> None:
    """A WritePages stream that names no generation, invalidated between its group's allocation and
    commit, was told "... the call names an older one (0) and changed nothing" (found by a review):
    it named none; its pages were allocated in generation 0. Refused still (DESIGN §12.4: what was
    written before an invalidation is dead), with what happened and what to do; nothing left."""
    keys = [secrets.token_bytes(16) for _ in range(2)]
    pages = [secrets.token_bytes(LayoutDesc.of(layout).page_bytes) for _ in keys]
    lay = layout_msg(LayoutDesc.of(layout))
    invalidated = threading.Event()

    def chunks() -> Iterator[data_pb2.PageChunk]:
        for i, (key, data) in enumerate(zip(keys, pages)):
            if i == 1 and not invalidated.wait(10):  # the group (both pages) is allocated by now, its commit not made
                return
            yield data_pb2.PageChunk(key=key, namespace_id=ns.namespace_id, layout=lay, page_bytes=len(data), offset=0,
                                     checksum=checksum(data), data=data, next_keys=keys[1:] if i == 0 else [])

    with grpc.insecure_channel(server.address) as channel:
        data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
        answer = data.WritePages.future(chunks(), timeout=10)
        for _ in range(1000):  # the stream's first page lands in its group's allocation
            if server.core.leases.counts().num_allocations == 1:
                break
            time.sleep(0.01)
        assert server.core.leases.counts().num_allocations == 1, "the stream's group was never allocated"
        directory.Invalidate(directory_pb2.InvalidateRequest(namespace_id=ns.namespace_id), timeout=5)
        invalidated.set()
        with pytest.raises(grpc.RpcError) as refused:
            answer.result()
        lookup = directory.Lookup(directory_pb2.LookupRequest(namespace_id=ns.namespace_id, keys=keys), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    assert "names an older one" not in details, details
    assert "allocated in generation 0" in details and "is at generation 1:" in details, details
    assert "not stored" in details and "look" in details, details
    assert lookup.num_pages == 0 and lookup.generation == 1
    assert server.core.leases.counts().num_allocations == 0 and not server.core.leases.counts().pinned
