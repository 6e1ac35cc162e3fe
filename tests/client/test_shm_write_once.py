"""A page written into the server's shared-memory arena is committed with the checksum of the
bytes its writer meant to write, never of bytes another process put into the slot. The arena
is shared memory (a stale allocation's writer, another writer of the tenant): writing the slot
and then hashing the slot stored foreign bytes written in between with a matching checksum, and
every reader then accepted them. Here the "other writer" changes the slot while the engine's
KV is being read (deterministic): the write of ``ShmTransport.write_slot`` from KV that is not
plain CPU rows, and a layer-wise save (``layerwise/save.py``) against a real server."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from support.kv import random_kv

from kvstore import KVLayout, pagecopy
from kvstore.client import KVStoreClient
from kvstore.client.engine_kv import ContiguousKV
from kvstore.client.layerwise import save as save_mod
from kvstore.client.transport.shm import ShmTransport
from kvstore.errors import KVStoreError
from kvstore.page import checksum

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_tokens=16)


class Arena:
    """An arena mapping: ``array`` the bytes, ``slot`` a tensor over a slot of them."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, dtype=np.uint8)

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        return torch.from_numpy(self.array[offset : offset + nbytes])


class ForeignWrites(ContiguousKV):
    """Engine KV whose last layer, when read, lets another writer flip the first byte of every
    page-sized block of ``shared`` (the arena): the slot's first layer was written by then."""

    def __init__(self, kv: torch.Tensor, layout: KVLayout, shared: Any) -> None:
        super().__init__(kv, layout)
        self.shared = shared
        self.flips = 0

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        if layer == self.layout.num_layers - 1:
            self.shared.array[:: self.layout.page_bytes] ^= 0xFF
            self.flips += 1
        return super().read_layer(page, layer)


def _page_bytes(kv: torch.Tensor, page: int, layout: KVLayout) -> np.ndarray:
    p = layout.page_tokens
    return kv[:, :, page * p : (page + 1) * p].contiguous().view(torch.uint8).numpy()


def test_write_slot_returns_the_checksum_of_the_bytes_meant_not_of_foreign_ones() -> None:
    pages = 3
    kv = random_kv(LAYOUT, pages * LAYOUT.page_tokens, seed=5)
    arena = Arena(pages * LAYOUT.page_bytes)
    engine = ForeignWrites(kv, LAYOUT, arena)
    shm = ShmTransport(SimpleNamespace(layout=LAYOUT), arena=None, copy_threads=1)  # type: ignore[arg-type]
    try:
        for page in range(pages):
            digest = shm.write_slot(engine, None, page, page * LAYOUT.page_bytes, arena)  # type: ignore[arg-type]
            assert digest == checksum(_page_bytes(kv, page, LAYOUT)), f"page {page}: the checksum of foreign bytes"
    finally:
        shm._pool.shutdown()
    assert engine.flips == pages


async def test_a_layerwise_save_under_a_writer_of_the_slots_stores_no_foreign_bytes(server, layout, ns) -> None:
    """The other writer flips a byte of each slot after its first layer was copied in. The save
    may be refused, or a get may find the page corrupt; a get that succeeds holds the KV saved
    (before the fix: the save committed the slot's bytes with their own checksum, and the get
    returned the flipped bytes as good)."""
    pages = 4
    tokens = list(range(pages * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=9)
    async with KVStoreClient(server.address, ns) as client:
        engine = ForeignWrites(kv, layout, client.transport.arena)
        save = client.save(tokens, engine)
        try:
            stored = await save.finished()
        except KVStoreError:
            stored = 0  # refused: allowed
        assert engine.flips == pages
        hit = await client.lookup(tokens)
        if stored and hit.num_tokens:
            out = torch.zeros_like(kv)
            try:
                await client.get(hit, into=out)
            except KVStoreError:
                return  # found corrupt: allowed
            n = hit.num_tokens
            assert torch.equal(out[:, :, :n].view(torch.uint8), kv[:, :, :n].view(torch.uint8)), \
                "a get returned bytes another writer put into the slots, stored with their own checksum"


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2, 0]], ids=str)
def test_layers_stored_in_any_order_get_the_checksum_of_the_page(monkeypatch, native: bool, order: list[int]) -> None:
    """The save's checksum is fed in page byte order from the bytes it copies: a layer the engine
    marks done before an earlier one is hashed when its turn comes."""
    monkeypatch.setattr(save_mod, "scatter_checksum", functools.partial(pagecopy.scatter_checksum, native=native))
    monkeypatch.setattr(save_mod, "running_checksum", functools.partial(pagecopy.running_checksum, native=native))
    pages = 3
    kv = random_kv(LAYOUT, (pages + 1) * LAYOUT.page_tokens, seed=7)
    buffers = [torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8) for _ in range(2)]
    copies = save_mod.LayerCopies(ContiguousKV(kv, LAYOUT), LAYOUT, 1, [0, 2], buffers)
    for layer in order:
        copies.copy(layer)
    want = [_page_bytes(kv, 1 + i, LAYOUT) for i in (0, 2)]
    assert copies.checksums() == [checksum(w) for w in want]
    assert all(np.array_equal(b.numpy(), w.reshape(-1)) for b, w in zip(buffers, want))
