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
from kvstore.page import checksum_rows
from kvstore.pagecopy import copy_checksum
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


def page_rows(kv: object, layout: KVLayout) -> KVRows | None:
    """``kv`` seen as rows of bytes, one per (layer, K/V), or None when it is not a CPU
    tensor whose strides allow that without a copy (then callers go through a page buffer)."""
    if not isinstance(kv, torch.Tensor) or kv.device.type != "cpu" or kv.stride(-1) != 1:
        return None
    num_rows = layout.num_layers * layout.kv_factor
    view = as_bytes(kv).numpy().view()
    try:
        view.shape = (num_rows, -1)  # raises rather than copy when the strides do not fold
    except AttributeError:
        return None
    return KVRows(view, layout.page_bytes // num_rows)


class KVRows:
    """An engine tensor as a uint8 array ``[layers*kv_factor, tokens*heads*dim*itemsize]``
    (a view): page ``p`` is the columns ``[p*run, (p+1)*run)`` of every row, its layer-major
    bytes row after row."""

    def __init__(self, rows: np.ndarray, run: int) -> None:
        self.rows = rows
        self.run = run

    def page(self, index: int) -> RowPage:
        return RowPage(self.rows[:, index * self.run : (index + 1) * self.run], self.run)


class RowPage:
    """Reads and writes byte ranges of one page of ``KVRows``: the flat layer-major offset
    ``o`` is row ``o // run``, column ``o % run``."""

    def __init__(self, rows: np.ndarray, run: int) -> None:
        self.rows = rows
        self.run = run
        self.nbytes = rows.shape[0] * run

    def checksum(self) -> int:
        """The page checksum (kvstore.page.checksum of its layer-major bytes), row by row."""
        return checksum_rows(self.rows)

    def _spans(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """(row, col_from, col_to, bytes before it) pieces of ``[start, end)``."""
        out = []
        pos = start
        while pos < end:
            row, col = divmod(pos, self.run)
            take = min(self.run - col, end - pos)
            out.append((row, col, col + take, pos - start))
            pos += take
        return out

    def clear(self) -> None:
        """Zeroes the page (a page that failed its check must not reach the engine)."""
        self.rows.fill(0)

    def write_all(self, data: memoryview) -> int:
        """Writes the whole page from its layer-major bytes and returns their checksum,
        computed as they are copied."""
        src = np.frombuffer(data, dtype=np.uint8).reshape(self.rows.shape[0], self.run)
        return copy_checksum(self.rows, src)

    def write(self, start: int, data: memoryview) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        end = start + len(src)
        first_row, col = divmod(start, self.run)
        if col == 0 and len(src) % self.run == 0:  # whole rows: one strided copy
            n = len(src) // self.run
            np.copyto(self.rows[first_row : first_row + n], src.reshape(n, self.run))
            return
        for row, c0, c1, before in self._spans(start, end):
            np.copyto(self.rows[row, c0:c1], src[before : before + c1 - c0])

    def pieces(self, start: int, end: int) -> list[memoryview]:
        """Views of the bytes ``[start, end)``, in order (for bytes.join and hashing)."""
        return [memoryview(self.rows[row, c0:c1]) for row, c0, c1, _ in self._spans(start, end)]
