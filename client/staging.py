"""Per-thread private page buffers: a page read from (or written to) the server's shared-memory
arena goes through one, so that what is verified or hashed is bytes no other process can change.

The buffer is kept per thread and per (size, pinned): pinning is slow, and whether a buffer is
pinned is kept beside it rather than asked of it (``Tensor.is_pinned()`` goes through
``cudaPointerGetAttributes`` where CUDA is available, which can start a CUDA context in a process
that copies only into CPU KV)."""

from __future__ import annotations

import threading

import torch

KEPT = 4  # buffers kept per thread (a thread may copy pages of a few sizes, pinned and not)

_local = threading.local()


def staging_page(nbytes: int, pinned: bool) -> torch.Tensor:
    """This thread's private buffer of ``nbytes`` bytes (uint8), page-locked when ``pinned`` (for a
    copy to or from a CUDA device). Its contents are whatever the thread's last use left: the
    caller fills it before it reads it, and is done with it before it asks again."""
    kept: dict[tuple[int, bool], torch.Tensor] | None = getattr(_local, "buffers", None)
    if kept is None:
        kept = _local.buffers = {}
    buffer = kept.pop((nbytes, pinned), None)
    if buffer is None:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        while len(kept) >= KEPT:
            kept.pop(next(iter(kept)))  # the one used longest ago
    kept[(nbytes, pinned)] = buffer  # the most recently used last
    return buffer
