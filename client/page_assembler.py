"""Putting the pages of a ReadPages stream back together (client side)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.client.pages import RowPage
from kvstore.errors import PageCorrupt
from kvstore.page_wire.grpc_chunks import BufferSink, ChunkedPage, PageSink, WireChunk


class PageAssembler:
    """Puts the pages of a ReadPages stream back together, in the order of ``keys``.

    ``feed`` returns True when a chunk completed a page (its checksum verified) and raises
    PageCorrupt for a chunk out of order, a wrong length or a bad checksum. Without a
    ``target`` the page collects in ``page`` (with ``reuse``, the same buffer every time:
    copy it out before the next feed). With a ``target`` (page index -> where that page of
    the engine's tensor lives) every chunk goes straight to its place, hashed as it passes,
    so a page is copied once; a page sent whole in one chunk (the default up to 4 MiB) is
    copied and hashed in one pass. A target page is valid only once ``feed`` returned True
    for it: one that fails, or that the stream leaves unfinished (``abandon``), is zeroed,
    so that no unverified byte reaches the caller. Each page is one ``kvstore.page_wire.grpc_chunks``
    ``ChunkedPage`` (the same reassembly the server's WritePages uses).
    """

    def __init__(self, keys: list[bytes], page_bytes: int, reuse: bool = True,
                 target: Callable[[int], RowPage] | None = None) -> None:
        self.keys = keys
        self.page_bytes = page_bytes
        self.reuse = reuse
        self.target = target
        self.count = 0  # pages finished
        self.page = torch.empty(0 if target else page_bytes, dtype=torch.uint8)
        self._current: ChunkedPage | None = None

    def abandon(self) -> None:
        """The stream ended or failed: zero the target page left half written, if any."""
        if self._current is not None:
            self._current.abandon()
        self._current = None

    def feed(self, chunk: WireChunk) -> bool:
        try:
            return self._feed(chunk)
        except PageCorrupt:
            self.abandon()
            raise

    def _feed(self, chunk: WireChunk) -> bool:
        if chunk.error:
            raise PageCorrupt(f"page {self.count}: {chunk.error}")
        if self.count >= len(self.keys):
            raise PageCorrupt(f"out-of-order chunk for page {self.count}: the stream has more pages than asked for")
        if self._current is None:
            if chunk.page_bytes != self.page_bytes:
                raise PageCorrupt(f"page {self.count} has {chunk.page_bytes} bytes, the layout needs {self.page_bytes}")
            self._current = ChunkedPage(self.keys[self.count], self.page_bytes, chunk.checksum, self._sink(),
                                        f"page {self.count}", PageCorrupt)
        if not self._current.add(chunk):
            return False
        self._current = None
        self.count += 1
        return True

    def _sink(self) -> PageSink:
        if self.target is not None:
            return self.target(self.count)
        if not self.reuse:
            self.page = torch.empty(self.page_bytes, dtype=torch.uint8)
        return BufferSink(self.page.numpy().data, clear_on_failure=False)
