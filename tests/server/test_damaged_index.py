"""A damaged SSD index entry costs its own page at a restart, nothing else: the other durable
pages of its namespace are recovered and served, and the namespace keeps its generation."""

from __future__ import annotations

import grpc
import pytest
import torch
from support.kv import random_kv
from support.servers import ENTRY_HEADER_AT, flip_index_byte

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import PageMissing
from kvstore.page import GENERATION_AT, HEADER_CORE_BYTES, NAMESPACE_AT


async def test_a_flipped_generation_in_one_index_entry_loses_only_that_page(server_factory, tmp_path, layout, ns) -> None:
    """Bug (found by the chaos model's ssd_flip fault, by reading what a restart trusts): recovery
    took each index entry's generation unchecked (``peek_generation``) and raised its namespace's
    generation to the newest one found, so one flipped bit in one entry's generation made every
    other page of the namespace 'of an invalidated generation': all deleted, acknowledged durable
    pages lost, and the namespace's generation raised to a garbage value."""
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=11)
    server = server_factory()
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv, durable=True) == 64
        hit = await client.lookup(tokens)
    generation, last = hit.generation, hit.keys[-1]
    server.stop(grace_s=1)
    flip_index_byte(tmp_path / "ssd", last, ENTRY_HEADER_AT + GENERATION_AT + 7, 0x01)  # + 2**56
    server = server_factory()
    async with KVStoreClient(server.address, ns) as client:
        hit = await client.lookup(tokens)
        assert hit.generation == generation
        assert hit.num_tokens >= 48, "the pages whose entries are whole must be recovered"
        out = torch.zeros_like(kv)
        got = await client.get(hit, into=out)
        assert got >= 48 and torch.equal(out[:, :, :got], kv[:, :, :got])


async def test_a_damaged_first_entry_of_a_namespace_is_quarantined_at_recovery_not_left_unlisted(server_factory, tmp_path,
                                                                                                  layout, ns) -> None:
    """Bug (the chaos model, seed 20006, check c): recovery reads a namespace's layout from its
    first page in index order, and left that page in the tier, unlisted, when its entry's header
    copy failed its check ("quarantined on first read", but a page nobody lists is never read).
    The node then took the page for stored: a put of it was acknowledged, and a fetch for a reader
    skipped it, while no lookup there listed it and no read could have it."""
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=12)
    server = server_factory()
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv, durable=True) == 64
        first = min((await client.lookup(tokens)).keys)  # index order is key order
    server.stop(grace_s=1)
    flip_index_byte(tmp_path / "ssd", first, ENTRY_HEADER_AT + HEADER_CORE_BYTES - 1, 0x01)  # the header's own check
    server = server_factory()
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv) == 64
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 64, "a put was acknowledged for a page this node does not list"
        out = torch.zeros_like(kv)
        assert await client.get(hit, into=out) == 64 and torch.equal(out, kv)


async def test_a_flipped_namespace_in_an_index_entry_lists_no_page_under_a_made_up_namespace(server_factory, tmp_path,
                                                                                             layout, ns) -> None:
    """A flipped bit in a middle entry's namespace id names a namespace nobody made: recovery
    must not list the page there (a location nothing can read, and a page the node takes for
    stored); the page is lost alone and its tokens are stored again by the next put."""
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=13)
    server = server_factory()
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv, durable=True) == 64
        keys = sorted((await client.lookup(tokens)).keys)
    server.stop(grace_s=1)
    flip_index_byte(tmp_path / "ssd", keys[1], ENTRY_HEADER_AT + NAMESPACE_AT, 0x01)
    server = server_factory()
    with grpc.insecure_channel(server.address) as channel:
        entries = directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10).num_entries
    assert entries == len(keys) - 1, f"{entries} pages listed: the damaged one under a namespace nobody made"
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv) == 64
        hit = await client.lookup(tokens)
        out = torch.zeros_like(kv)
        assert hit.num_tokens == 64 and await client.get(hit, into=out) == 64 and torch.equal(out, kv)


async def test_a_page_whose_index_entry_fails_its_check_is_not_promised_after_the_read_that_finds_it(server_factory, tmp_path,
                                                                                                      layout, ns) -> None:
    """Bug (the chaos model, seed 46013, check c: an ssd_flip's index flips on a node, then its
    restart): a page whose SSD index entry's header copy fails its own check is kept by the SSD
    tier (so that the scrub finds it) and listed at recovery, but no read can have it (its entry
    has no header to read by): every get stopped short of it and every lookup promised it again,
    15 s after the heal. The read that finds it must quarantine it, as one that finds bad bytes does."""
    tokens = list(range(64))
    kv = random_kv(layout, 64, seed=13)
    server = server_factory()
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv, durable=True) == 64
        keys = (await client.lookup(tokens)).keys
    server.stop(grace_s=1)
    damaged = keys[2]
    assert damaged != min(keys), "not the namespace's first page in index order (recovery reads that one)"
    flip_index_byte(tmp_path / "ssd", damaged, ENTRY_HEADER_AT + HEADER_CORE_BYTES - 1, 0x01)  # the header's own check
    server = server_factory()
    async with KVStoreClient(server.address, ns) as client:
        hit = await client.lookup(tokens)
        out = torch.zeros_like(kv)
        with pytest.raises(PageMissing) as short:
            await client.get(hit, into=out)
        assert short.value.num_tokens == 32 and torch.equal(out[:, :, :32], kv[:, :, :32]), "pages 0 and 1 are whole"
        assert (await client.lookup(tokens)).num_tokens == 32, "the page no read can have is promised again"
