"""A damaged SSD index entry costs its own page at a restart, nothing else: the other durable
pages of its namespace are recovered and served, and the namespace keeps its generation."""

from __future__ import annotations

from pathlib import Path

import lmdb
import torch
from support.kv import random_kv

from kvstore.client import KVStoreClient
from kvstore.page import GENERATION_AT
from kvstore.tiers.ssd import INDEX_DIR

ENTRY_HEADER_AT = 16  # an index entry's value: offset u64, slot bytes u64, then the page header's core


def _flip_index_byte(ssd_dir: Path, key: bytes, at: int, mask: int) -> None:
    """XORs one byte of ``key``'s index entry (the server is stopped)."""
    env = lmdb.open(str(ssd_dir / INDEX_DIR), subdir=True, max_dbs=4)
    try:
        db = env.open_db(b"index", create=False)
        with env.begin(write=True, db=db) as txn:
            value = bytearray(txn.get(key))
            value[at] ^= mask
            txn.put(key, bytes(value))
    finally:
        env.close()


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
    _flip_index_byte(tmp_path / "ssd", last, ENTRY_HEADER_AT + GENERATION_AT + 7, 0x01)  # + 2**56
    server = server_factory()
    async with KVStoreClient(server.address, ns) as client:
        hit = await client.lookup(tokens)
        assert hit.generation == generation
        assert hit.num_tokens >= 48, "the pages whose entries are whole must be recovered"
        out = torch.zeros_like(kv)
        got = await client.get(hit, into=out)
        assert got >= 48 and torch.equal(out[:, :, :got], kv[:, :, :got])
