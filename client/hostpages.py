"""Where an engine's KV pages lie in host memory, as byte offsets into one buffer.

More: client/README.md (### hostpages.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.pagecopy import scatter_checksum
from kvstore.types import KVLayout


@dataclass(frozen=True)
class HostPages:
    """Page ``i``, layer ``l`` of an engine KV: ``shape`` bytes (``[kv, P, heads, dim bytes]``)
    from byte ``offsets[i] + l * layer_step`` of ``buffer`` on, by ``strides`` (bytes of the
    first three dimensions)."""

    buffer: np.ndarray
    offsets: list[int]
    layer_step: int
    strides: tuple[int, ...]
    shape: tuple[int, ...]

    def write_layer(self, layer: int, pages: Sequence[int], sources: Sequence[Any], sums: Sequence[Any]) -> None:
        """Copies ``sources[j]`` (layer ``layer`` of a page, contiguous bytes) into page
        ``pages[j]`` and feeds them to ``sums[j]``."""
        at = layer * self.layer_step
        scatter_checksum(sums, self.buffer, [self.offsets[p] + at for p in pages], self.strides, self.shape, sources)

    def write_pages(self, num_layers: int, pages: Sequence[int], sources: Sequence[Any], sums: Sequence[Any]) -> None:
        """Copies whole pages (``sources[j]``: every layer, layer-major) into ``pages[j]``
        and feeds them to ``sums[j]``: one call for all layers."""
        scatter_checksum(sums, self.buffer, [self.offsets[p] for p in pages], (self.layer_step, *self.strides),
                         (num_layers, *self.shape), sources)


def host_pages(layers: torch.Tensor, page_starts: Sequence[tuple[int, ...]], layout: KVLayout) -> HostPages | None:
    """``HostPages`` of ``layers``, a view ``[layers, *lead, kv, tokens, heads, dim]`` of an
    engine KV (``lead``: e.g. the block dimension of a paged cache), where page ``i``
    starts at index ``page_starts[i]`` (one entry per ``lead`` dimension, then the token);
    None when the view is not a CPU tensor with a contiguous last dimension and
    non-negative strides."""
    if layers.device.type != "cpu" or layers.dim() < 5 or layers.stride(-1) != 1 or min(layers.stride()) < 0:
        return None
    size = layers.element_size()
    strides = layers.stride()
    lead = strides[1:-4]  # block-like dimensions between the layer and the kv one
    token = strides[-3]
    base = layers.storage_offset()
    offsets = [(base + sum(i * s for i, s in zip(start[:-1], lead)) + start[-1] * token) * size for start in page_starts]
    buffer = torch.empty(0, dtype=torch.uint8).set_(layers.untyped_storage()).numpy()
    return HostPages(buffer, offsets, strides[0] * size, (strides[-4] * size, token * size, strides[-2] * size),
                     (layout.kv_factor, layout.page_tokens, layout.num_kv_heads, layout.head_dim * size))
