"""Engine KV formats the client reads from and writes into.

* ``ContiguousKV``: one tensor ``[layers, kv, tokens, heads, dim]`` (the foundation format).
* ``PagedKV``: vLLM-style paged blocks, one tensor per layer ``[num_blocks, kv, block_size,
  heads, dim]`` plus the sequence's block table (token t lives in block
  ``block_table[t // block_size]`` at slot ``t % block_size``).

Both expose one page's slice of one layer as ``[kv, page_tokens, heads, dim]``; the
client copies whole pages (all layers) or single layers through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvstore.client.hostpages import HostPages, host_pages
from kvstore.client.pages import check_kv, copy_bytes
from kvstore.errors import InvalidRequest
from kvstore.types import KVLayout


class EngineKV(Protocol):
    num_tokens: int

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        """Layer ``layer`` of page ``page`` as ``[kv, P, heads, dim]`` (a view or a copy)."""
        ...

    def write_layer(self, page: int, layer: int, src: torch.Tensor) -> None:
        """Stores ``src`` (``[kv, P, heads, dim]``) as layer ``layer`` of page ``page``."""
        ...


class ContiguousKV:
    def __init__(self, kv: torch.Tensor, layout: KVLayout) -> None:
        check_kv(kv, layout, 0)
        self.kv = kv
        self.layout = layout
        self.num_tokens = kv.shape[2]

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        p = self.layout.page_tokens
        return self.kv[layer, :, page * p : (page + 1) * p]

    def write_layer(self, page: int, layer: int, src: torch.Tensor) -> None:
        copy_bytes(self.read_layer(page, layer), src)

    def host_pages(self) -> HostPages | None:
        """The pages as places in host memory (a layer-wise load copies and checksums a
        layer of every page in one call); None for a tensor off the CPU."""
        p = self.layout.page_tokens
        return host_pages(self.kv, [(i * p,) for i in range(self.num_tokens // p)], self.layout)


class PagedKV:
    """A sequence's KV inside an engine's paged block pool."""

    def __init__(self, layers: Sequence[torch.Tensor], block_table: Sequence[int], num_tokens: int, layout: KVLayout) -> None:
        if len(layers) != layout.num_layers:
            raise InvalidRequest(f"PagedKV has {len(layers)} layer tensors, the layout has {layout.num_layers}")
        first = layers[0]
        if first.dim() != 5 or first.shape[1] != layout.kv_factor or tuple(first.shape[3:]) != (layout.num_kv_heads, layout.head_dim):
            raise InvalidRequest(
                f"paged layer tensors must be [num_blocks, {layout.kv_factor}, block_size, {layout.num_kv_heads}, {layout.head_dim}], "
                f"got {list(first.shape)}"
            )
        if first.dtype != layout.torch_dtype():
            raise InvalidRequest(f"paged KV has dtype {first.dtype}, the namespace layout says {layout.dtype_name}")
        self.block_size = first.shape[2]
        if len(block_table) * self.block_size < num_tokens:
            raise InvalidRequest(f"block table of {len(block_table)} blocks cannot hold {num_tokens} tokens")
        self.layers = list(layers)
        self.layout = layout
        self.num_tokens = num_tokens
        table = torch.as_tensor(list(block_table), dtype=torch.long)
        t = torch.arange(len(block_table) * self.block_size)
        self._blocks = table[t // self.block_size]
        self._slots = t % self.block_size

    def _index(self, page: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.layout.page_tokens
        return self._blocks[page * p : (page + 1) * p], self._slots[page * p : (page + 1) * p]

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        blocks, slots = self._index(page)
        # [P, kv, heads, dim] -> [kv, P, heads, dim]
        return self.layers[layer][blocks, :, slots].transpose(0, 1)

    def write_layer(self, page: int, layer: int, src: torch.Tensor) -> None:
        blocks, slots = self._index(page)
        self.layers[layer][blocks, :, slots] = src.transpose(0, 1).to(self.layers[layer].device)


def as_engine_kv(kv: torch.Tensor | EngineKV, layout: KVLayout) -> EngineKV:
    return ContiguousKV(kv, layout) if isinstance(kv, torch.Tensor) else kv
