"""How an attention backend lays out one layer of vLLM's paged KV cache.

kvstore copies pages through ``RequestKV``, which reads and writes one layer as
``[num_blocks, 2 (K|V), block_size, num_kv_heads, head_size]``. Each backend
keeps another physical layout; a ``BlockLayout`` turns the backend's per-layer tensor into
that logical view without copying (writes through the view land in vLLM's cache). A new
backend is one small class here plus one line in ``LAYOUTS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvstore.client.hostpages import HostPages, host_pages
from kvstore.errors import ConfigError, InvalidRequest
from kvstore.types import KVLayout


class BlockLayout(Protocol):
    """Maps a backend's per-layer KV tensor to ``[blocks, 2, block_size, heads, dim]``."""

    name: str

    def matches(self, kv: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int) -> bool:
        """True when ``kv`` has this layout's shape for the given dimensions."""
        ...

    def blocks(self, kv: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int) -> torch.Tensor:
        """A view (never a copy) of ``kv`` as ``[blocks, 2, block_size, heads, dim]``; with a
        leading layer dimension (all layers stacked), ``[layers, blocks, 2, ...]``."""
        ...


class CpuLayout:
    """vLLM's CPU backend: ``[blocks, heads, block_size, 2*head_size]``. Inside a block and
    a head the memory holds the ``block_size`` K rows, then the ``block_size`` V rows (the
    backend views it as ``[blocks, heads, 2*block_size, head_size]`` and splits dim 2)."""

    name = "cpu"

    def matches(self, kv: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int) -> bool:
        return kv.dim() == 4 and tuple(kv.shape[1:]) == (num_kv_heads, block_size, 2 * head_size)

    def blocks(self, kv: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int) -> torch.Tensor:
        view = kv.view(*kv.shape[:-3], num_kv_heads, 2, block_size, head_size)  # [..., blocks, H, 2, N, D]
        lead = view.dim() - 4
        return view.permute(*range(lead), lead + 1, lead + 2, lead, lead + 3)  # [..., blocks, 2, N, H, D]


class SplitKVLayout:
    """The classic flash-attention layout ``[2, blocks, block_size, heads, head_size]``
    (K and V in separate halves, tokens before heads)."""

    name = "split-nhd"

    def matches(self, kv: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int) -> bool:
        return kv.dim() == 5 and kv.shape[0] == 2 and tuple(kv.shape[2:]) == (block_size, num_kv_heads, head_size)

    def blocks(self, kv: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int) -> torch.Tensor:
        return kv.transpose(-5, -4)


LAYOUTS: tuple[BlockLayout, ...] = (CpuLayout(), SplitKVLayout())


def stacked(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """All layers as one view ``[layers, *layer shape]`` when vLLM carved them out of one
    buffer at a fixed distance (it does: one KV cache tensor per group), so that a page is
    copied with one call rather than one per layer; None otherwise."""
    first = kv_caches[0]
    if len(kv_caches) < 2:
        return first.unsqueeze(0)
    step = kv_caches[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % first.element_size():
        return None
    for i, kv in enumerate(kv_caches):
        if (kv.shape != first.shape or kv.stride() != first.stride() or kv.dtype != first.dtype
                or kv.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or kv.data_ptr() != first.data_ptr() + i * step):
            return None
    return first.as_strided((len(kv_caches), *first.shape), (step // first.element_size(), *first.stride()),
                            first.storage_offset())


def block_views(kv_caches: Sequence[torch.Tensor], block_size: int, num_kv_heads: int,
                head_size: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Every layer's tensor as ``[blocks, 2, block_size, heads, dim]``, and all layers as
    ``[layers, blocks, 2, ...]`` where they share one buffer, through the first layout whose
    shape matches; a clear error when none does."""
    first = kv_caches[0]
    for layout in LAYOUTS:
        if layout.matches(first, block_size, num_kv_heads, head_size):
            layers = [layout.blocks(kv, block_size, num_kv_heads, head_size) for kv in kv_caches]
            together = stacked(kv_caches)
            return layers, None if together is None else layout.blocks(together, block_size, num_kv_heads, head_size)
    raise ConfigError(
        f"unsupported vLLM KV cache layout {list(first.shape)} (block_size={block_size}, heads={num_kv_heads}, "
        f"head_size={head_size}); known: {[layout.name for layout in LAYOUTS]} (client/adapters/vllm/layout.py)"
    )


class RequestKV:
    """One request's pages in vLLM's paged cache (an ``EngineKV``), from page
    ``first_page`` of the request on. A page lies inside one block (page_tokens divides
    block_size), so each page and layer is a plain view of the block tensor: copies are
    strided ``copy_`` calls, never gathers. ``cancel()`` makes every later access raise,
    which is how a layer-wise save that must not be published is stopped: its worker fails
    and aborts the allocation instead of committing. With ``guarded`` only layers handed
    over with ``release_layer`` may be read: a save that is ended early (its client closes)
    fails on a layer vLLM has not computed yet rather than publish it."""

    def __init__(self, blocks: Sequence[torch.Tensor], block_ids: Sequence[int], first_page: int, num_pages: int,
                 layout: KVLayout, guarded: bool = False, all_layers: torch.Tensor | None = None) -> None:
        block_size = blocks[0].shape[2]
        p = layout.page_tokens
        if block_size % p:
            raise InvalidRequest(f"pages of {p} tokens do not tile vLLM blocks of {block_size}")
        if len(block_ids) * block_size < (first_page + num_pages) * p:
            raise InvalidRequest(f"{len(block_ids)} blocks cannot hold {first_page + num_pages} pages")
        self.blocks = blocks
        self.block_ids = list(block_ids)
        self.num_tokens = num_pages * p
        # page -> (block id, first slot in the block)
        self._where = [(self.block_ids[t // block_size], t % block_size)
                       for t in ((first_page + i) * p for i in range(num_pages))]
        self._p = p
        self._layout = layout
        self._all_layers = all_layers
        self._cancelled = False
        self._readable: set[int] | None = set() if guarded else None

    def cancel(self) -> None:
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def release_layer(self, layer: int) -> None:
        """vLLM has computed ``layer``: a guarded save may read it now."""
        if self._readable is not None:
            self._readable.add(layer)

    def _view(self, page: int, layer: int) -> torch.Tensor:
        block, slot = self._where[page]
        return self.blocks[layer][block, :, slot : slot + self._p]

    def read_layer(self, page: int, layer: int) -> torch.Tensor:
        if self._cancelled:
            raise InvalidRequest("save cancelled: the KV of this step is not to be published")
        if self._readable is not None and layer not in self._readable:
            raise InvalidRequest(f"layer {layer} is not computed yet: the save ended early")
        return self._view(page, layer)

    def write_layer(self, page: int, layer: int, src: torch.Tensor) -> None:
        if self._cancelled:
            raise InvalidRequest("load cancelled")
        self._view(page, layer).copy_(src)

    def host_pages(self) -> HostPages | None:
        """The pages as places in host memory (one copy+checksum call per layer), when the
        layers share one CPU buffer; None otherwise."""
        if self._all_layers is None or self._cancelled:
            return None
        return host_pages(self._all_layers, self._where, self._layout)

    def write_page(self, page: int, src: torch.Tensor) -> None:
        """Stores a whole page (``[layers, 2, P, heads, dim]``): one copy when the layers
        share one buffer, else one per layer."""
        if self._cancelled:
            raise InvalidRequest("load cancelled")
        if self._all_layers is None:
            for layer in range(src.shape[0]):
                self._view(page, layer).copy_(src[layer])
            return
        block, slot = self._where[page]
        self._all_layers[:, block, :, slot : slot + self._p].copy_(src)
