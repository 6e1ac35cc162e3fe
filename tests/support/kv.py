"""The tests' small page layout (``SMALL``, the ``layout`` fixture's) and seeded random KV tensors."""

from __future__ import annotations

import torch

from kvstore import KVLayout

SMALL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)


def random_kv(layout: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, layout.kv_factor, tokens, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=g).to(layout.torch_dtype())
