"""Moving pages between an engine's KV tensor and page bytes.

The engine tensor is ``[layers, kv, tokens, heads, dim]``; page ``p`` is the token slice
``[p*P, (p+1)*P)`` of every layer, stored layer-major, which makes the copy 2·layers
contiguous runs. CPU copies go through numpy on byte views: they release the GIL and use
one core each, so a small thread pool copies pages in parallel without fighting torch's
own intra-op threads.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.errors import InvalidRequest
from kvstore.types import KVLayout


def check_kv(kv: torch.Tensor, layout: KVLayout, min_tokens: int, name: str = "kv") -> None:
    """Raises InvalidRequest unless ``kv`` is a [layers, kv, tokens, heads, dim] tensor of the layout."""
    want = (layout.num_layers, layout.kv_factor, layout.num_kv_heads, layout.head_dim)
    if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
        raise InvalidRequest(
            f"{name} must have shape [num_layers={want[0]}, {want[1]}, tokens, num_kv_heads={want[2]}, head_dim={want[3]}], "
            f"got {list(kv.shape)}"
        )
    if kv.dtype != layout.torch_dtype():
        raise InvalidRequest(f"{name} has dtype {kv.dtype}, the namespace layout says {layout.dtype_name}")
    if kv.shape[2] < min_tokens:
        raise InvalidRequest(f"{name} holds {kv.shape[2]} tokens, {min_tokens} are needed")
    if kv.stride(-1) != 1:
        raise InvalidRequest(f"{name} must be contiguous in its last dimension")


def page_of(kv: torch.Tensor, page: int, page_tokens: int) -> torch.Tensor:
    return kv[:, :, page * page_tokens : (page + 1) * page_tokens]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view (last dim scaled by the element size); no copy."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, both viewed as bytes of the same shape."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(as_bytes(dst).numpy(), as_bytes(src).numpy())
    else:
        dst.copy_(src, non_blocking=False)


def slot_as_page(slot: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A uint8 slot tensor viewed as one page of the layout."""
    return slot[: layout.page_bytes].view(layout.torch_dtype()).view(layout.page_shape())
