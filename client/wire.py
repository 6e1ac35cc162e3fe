"""Putting the pages of a ReadPages stream back together (client side)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.client.pages import RowPage
from kvstore.errors import PageCorrupt
from kvstore.page import checksum, checksummer
from kvstore.wire import WireChunk


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
    so that no unverified byte reaches the caller.
    """

    def __init__(self, keys: list[bytes], page_bytes: int, reuse: bool = True,
                 target: Callable[[int], RowPage] | None = None) -> None:
        self.keys = keys
        self.page_bytes = page_bytes
        self.reuse = reuse
        self.target = target
        self.count = 0  # pages finished
        self.page = torch.empty(0 if target else page_bytes, dtype=torch.uint8)
        self._filled = 0
        self._expect = 0
        self._hash = checksummer()

    def abandon(self) -> None:
        """The stream ended or failed: zero the target page left half written, if any."""
        if self.target is not None and self._filled:
            self.target(self.count).clear()
        self._filled = 0

    def feed(self, chunk: WireChunk) -> bool:
        try:
            return self._feed(chunk)
        except PageCorrupt:
            self.abandon()
            raise

    def _feed(self, chunk: WireChunk) -> bool:
        if chunk.error:
            raise PageCorrupt(f"page {self.count}: {chunk.error}")
        if self.count >= len(self.keys) or chunk.key != self.keys[self.count] or chunk.offset != self._filled:
            raise PageCorrupt(f"out-of-order chunk for page {self.count}")
        if self._filled == 0:
            if chunk.page_bytes != self.page_bytes:
                raise PageCorrupt(f"page {self.count} has {chunk.page_bytes} bytes, the layout needs {self.page_bytes}")
            if self.target is None and not self.reuse:
                self.page = torch.empty(self.page_bytes, dtype=torch.uint8)
            self._expect = chunk.checksum
            if self.target is not None and len(chunk.data) == self.page_bytes:
                self._filled = self.page_bytes  # written, not yet verified
                if self.target(self.count).write_all(chunk.data) != self._expect:
                    raise PageCorrupt(f"page {self.count} failed its checksum in transit")
                self._filled = 0
                self.count += 1
                return True
            self._hash.reset()
        end = self._filled + len(chunk.data)
        if end > self.page_bytes:
            raise PageCorrupt(f"page {self.count} got more than its {self.page_bytes} bytes")
        if self.target is not None:
            self._hash.update(chunk.data)
            self.target(self.count).write(self._filled, chunk.data)
        else:
            self.page.numpy()[self._filled : end] = memoryview(chunk.data)
        self._filled = end
        if end < self.page_bytes:
            return False
        digest = self._hash.intdigest() if self.target is not None else checksum(self.page.numpy())
        if digest != self._expect:
            raise PageCorrupt(f"page {self.count} failed its checksum in transit")
        self._filled = 0
        self.count += 1
        return True
