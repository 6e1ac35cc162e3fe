"""Pages of a hybrid engine, copied between vLLM's per-group block tables and a staging
tensor ``[layers, 2, tokens, heads, dim]`` (the canonical page layout, layers in page
order: groups.py).

More: client/adapters/vllm/README.md (### grouped.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.client.adapters.vllm.groups import NULL_BLOCK
from kvstore.errors import InvalidRequest
from kvstore.types import KVLayout


def pages_with_data(block_ids: Sequence[Sequence[int]], block_size: int, page_tokens: int, first_page: int,
                    end_page: int) -> int:
    """The end of the run of pages from ``first_page`` (before ``end_page``) whose blocks
    hold data in every group (``block_ids[g]``: group g's table): a page with a null block
    in any group, or past a group's table, ends it."""
    for page in range(first_page, end_page):
        index = page * page_tokens // block_size
        if any(index >= len(ids) or ids[index] == NULL_BLOCK for ids in block_ids):
            return page
    return end_page


class GroupedBlocks:
    """Every layer's paged KV (``[blocks, 2, block_size, heads, dim]`` views, layout.py),
    each with the index of its KV cache group."""

    def __init__(self, blocks: Sequence[torch.Tensor], layer_groups: Sequence[int], layout: KVLayout) -> None:
        if len(blocks) != len(layer_groups):
            raise InvalidRequest(f"{len(blocks)} layer caches for {len(layer_groups)} layers")
        self.blocks = list(blocks)
        self.layer_groups = list(layer_groups)
        self.layout = layout
        self.block_size = blocks[0].shape[2]
        if self.block_size % layout.page_tokens:
            raise InvalidRequest(f"pages of {layout.page_tokens} tokens do not tile vLLM blocks of {self.block_size}")

    def _where(self, block_ids: Sequence[int], page: int) -> tuple[int, int]:
        """(block, first slot in it) of ``page`` in one group's block table."""
        token = page * self.layout.page_tokens
        index = token // self.block_size
        if index >= len(block_ids):
            raise InvalidRequest(f"page {page} lies past the {len(block_ids)} blocks of the request")
        return block_ids[index], token % self.block_size

    def staging(self, num_pages: int) -> torch.Tensor:
        """An empty staging tensor for ``num_pages`` pages."""
        lay = self.layout
        return torch.empty((lay.num_layers, lay.kv_factor, num_pages * lay.page_tokens, lay.num_kv_heads, lay.head_dim),
                           dtype=lay.dtype, device=self.blocks[0].device)

    def gather(self, block_ids: Sequence[Sequence[int]], first_page: int, num_pages: int) -> torch.Tensor:
        """Pages ``[first_page, first_page + num_pages)`` of a request, every layer from its
        group's blocks, as a new staging tensor; a null block among them is an error."""
        end, tables = first_page + num_pages, [block_ids[g] for g in sorted(set(self.layer_groups))]
        if pages_with_data(tables, self.block_size, self.layout.page_tokens, first_page, end) < end:
            raise InvalidRequest("a page to save has a dropped (null) block")
        out, p = self.staging(num_pages), self.layout.page_tokens
        for layer, group in enumerate(self.layer_groups):
            for i in range(num_pages):
                block, slot = self._where(block_ids[group], first_page + i)
                out[layer, :, i * p : (i + 1) * p].copy_(self.blocks[layer][block, :, slot : slot + p])
        return out

    def scatter(self, pages: torch.Tensor, block_ids: Sequence[Sequence[int]], first_page: int) -> int:
        """Writes the staging tensor ``pages`` as the request's pages from ``first_page`` on,
        every layer into its group's blocks, skipping null blocks (tokens outside a window
        group's window: no future token reads them). Returns how many (page, layer) slices
        were skipped."""
        p = self.layout.page_tokens
        num_pages, skipped = pages.shape[2] // p, 0
        for layer, group in enumerate(self.layer_groups):
            for i in range(num_pages):
                block, slot = self._where(block_ids[group], first_page + i)
                if block == NULL_BLOCK:
                    skipped += 1
                    continue
                self.blocks[layer][block, :, slot : slot + p].copy_(pages[layer, :, i * p : (i + 1) * p])
        return skipped
