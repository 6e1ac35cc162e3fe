"""Leased pages copied from the server's shared-memory arenas into a request's blocks, each page's
checksum verified: the one copy an ordinary leased load (worker.py) and a handoff's receive
(pd_leases.py) both make."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.client.adapters.vllm.layout import RequestKV
from kvstore.client.arena import ArenaMap
from kvstore.client.pages import slot_as_page
from kvstore.client.staging import staging_page
from kvstore.page import checksum
from kvstore.pagecopy import running_checksum
from kvstore.types import KVLayout


def copy_verified(kv: RequestKV, layout: KVLayout, sources: Sequence[tuple[ArenaMap, int]], sums: Sequence[int],
                  on_device: bool) -> int | None:
    """Copies page i from ``sources[i]`` (an arena and the page's offset in it) into ``kv``'s page i; the
    index of the first page whose bytes fail ``sums[i]``, None when all pass. Into a CPU cache one native
    call copies and checksums every page (the caller fails the blocks from the bad one on); into device KV
    or per-layer caches each page is read once from the arena into a private buffer, checked there and
    copied from there: the arena is shared memory, and a second read could see bytes never verified. A
    page that fails is not copied, nor any after it."""
    n = layout.page_bytes
    host = None if on_device else kv.host_pages()
    if host is not None:
        running = [running_checksum() for _ in sources]
        host.write_pages(layout.num_layers, range(len(sources)), [arena.array[o : o + n] for arena, o in sources], running)
        return next((i for i, s in enumerate(running) if s.intdigest() != sums[i]), None)
    staging = staging_page(n, on_device and torch.cuda.is_available())  # pinned for a device copy where CUDA is
    for i, (arena, offset) in enumerate(sources):
        np.copyto(staging.numpy(), arena.array[offset : offset + n])  # the one read of the shared arena
        if checksum(staging.numpy()) != sums[i]:
            return i
        kv.write_page(i, slot_as_page(staging, layout))  # a blocking copy: the buffer is free again after it
    return None
