"""Putting the pages of a ReadPages stream back together (client side)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.errors import PageCorrupt
from kvstore.page import checksum, checksummer
from kvstore.wire import WireChunk

Sink = Callable[[int, int, memoryview], None]  # (page index, byte offset, bytes)
WholeSink = Callable[[int, memoryview], int]  # (page index, all its bytes) -> their checksum


class PageAssembler:
    """Puts the pages of a ReadPages stream back together, in the order of ``keys``.

    ``feed`` returns True when a chunk completed a page (its checksum verified) and raises
    PageCorrupt for a chunk out of order, a wrong length or a bad checksum. Without a
    ``sink`` the page collects in ``page`` (with ``reuse``, the same buffer every time: copy
    it out before the next feed). With a ``sink`` every chunk goes straight to its place
    and the checksum is computed as the bytes pass, so a page is copied once; the sink's
    page is then valid only once ``feed`` returned True for it. A page that arrives in one
    chunk (the default for pages up to 4 MiB) goes to ``whole`` when given, which places it
    and returns its checksum in one pass; a page that fails is zeroed, so that no byte of
    it reaches the caller.
    """

    def __init__(self, keys: list[bytes], page_bytes: int, reuse: bool = True, sink: Sink | None = None,
                 whole: WholeSink | None = None) -> None:
        self.keys = keys
        self.page_bytes = page_bytes
        self.reuse = reuse
        self.sink = sink
        self.whole = whole
        self.count = 0  # pages finished
        self.page = torch.empty(0 if sink else page_bytes, dtype=torch.uint8)
        self._filled = 0
        self._expect = 0
        self._hash = checksummer()

    def feed(self, chunk: WireChunk) -> bool:
        if chunk.error:
            raise PageCorrupt(f"page {self.count}: {chunk.error}")
        if self.count >= len(self.keys) or chunk.key != self.keys[self.count] or chunk.offset != self._filled:
            raise PageCorrupt(f"out-of-order chunk for page {self.count}")
        if self._filled == 0:
            if chunk.page_bytes != self.page_bytes:
                raise PageCorrupt(f"page {self.count} has {chunk.page_bytes} bytes, the layout needs {self.page_bytes}")
            if self.sink is None and not self.reuse:
                self.page = torch.empty(self.page_bytes, dtype=torch.uint8)
            self._expect = chunk.checksum
            if self.whole is not None and len(chunk.data) == self.page_bytes:
                if self.whole(self.count, chunk.data) != self._expect:
                    self.whole(self.count, memoryview(bytes(self.page_bytes)))  # wipe it
                    raise PageCorrupt(f"page {self.count} failed its checksum in transit")
                self.count += 1
                return True
            self._hash.reset()
        end = self._filled + len(chunk.data)
        if end > self.page_bytes:
            raise PageCorrupt(f"page {self.count} got more than its {self.page_bytes} bytes")
        if self.sink is not None:
            self._hash.update(chunk.data)
            self.sink(self.count, self._filled, chunk.data)
        else:
            self.page.numpy()[self._filled : end] = memoryview(chunk.data)
        self._filled = end
        if end < self.page_bytes:
            return False
        digest = self._hash.intdigest() if self.sink is not None else checksum(self.page.numpy())
        if digest != self._expect:
            raise PageCorrupt(f"page {self.count} failed its checksum in transit")
        self._filled = 0
        self.count += 1
        return True
