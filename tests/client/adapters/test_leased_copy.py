"""A leased page is verified and copied from one read of the arena (leased_copy.copy_verified).
The arena is shared memory: a writer with a stale slot, or another process mapping the arena,
may change a page's bytes while an engine copies it. Checking the checksum on one read and then
copying from a second read would let bytes that were never verified into the engine's KV. The
arena here changes a page's bytes on every read after the first; what lands must be what was
verified, on the path of per-layer caches and of device KV (the CPU implementation of it), and
on the one-call path of a shared CPU buffer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from support.changing_arena import ChangingArena

from kvstore import KVLayout
from kvstore.client.adapters.vllm.layout import RequestKV, block_views
from kvstore.client.adapters.vllm.leased_copy import copy_verified
from kvstore.page import checksum

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS, PAGES = 16, 2, 8, 3, 8, 3
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, page_tokens=BLOCK)


def _caches(shared: bool) -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)  # vLLM's CPU layout
    if shared:
        raw = torch.zeros(LAYERS, *shape)
        return [raw[i] for i in range(LAYERS)]
    return [torch.zeros(shape) for _ in range(LAYERS)]


@pytest.mark.parametrize("shared, on_device", [(False, False), (False, True), (True, False)],
                         ids=["per-layer", "device", "one-buffer"])
def test_what_lands_is_what_was_verified(shared: bool, on_device: bool) -> None:
    pages = np.random.default_rng(1).integers(0, 256, (PAGES, LAYOUT.page_bytes), dtype=np.uint8)
    sums = [checksum(page) for page in pages]
    arena: Any = ChangingArena(pages)
    caches = _caches(shared)
    layers, together = block_views(caches, BLOCK, HEADS, DIM)
    block_ids = [5, 1, 6]
    kv = RequestKV(layers, block_ids, 0, PAGES, LAYOUT, all_layers=together)
    bad = copy_verified(kv, LAYOUT, [(arena, i * LAYOUT.page_bytes) for i in range(PAGES)], sums, on_device)
    landed = 0 if bad == 0 else (PAGES if bad is None else bad)
    for i in range(landed):  # each page reported good holds exactly the verified bytes
        got = torch.stack([kv.read_layer(i, layer) for layer in range(LAYERS)])
        assert checksum(got.contiguous().view(torch.uint8).numpy()) == sums[i], f"page {i} landed unverified bytes"
    assert landed >= 1  # the first read was intact: at least its page is good
