"""Putting the pages of a ReadPages stream back together (client side)."""

from __future__ import annotations

import torch

from kvstore._proto import data_pb2
from kvstore.errors import PageCorrupt
from kvstore.page import checksum


class PageAssembler:
    """Puts the pages of a ReadPages stream back together, in the order of ``keys``.

    ``feed`` returns a finished page (uint8 tensor of ``page_bytes``, checksum verified) or
    None, and raises PageCorrupt for a chunk out of order, a wrong length or a bad checksum.
    With ``reuse`` every page lands in the same buffer (copy it out before the next feed).
    """

    def __init__(self, keys: list[bytes], page_bytes: int, reuse: bool = True) -> None:
        self.keys = keys
        self.page_bytes = page_bytes
        self.reuse = reuse
        self.count = 0  # pages finished
        self._buf = torch.empty(page_bytes, dtype=torch.uint8)
        self._filled = 0
        self._expect = 0

    def feed(self, chunk: data_pb2.PageChunk) -> torch.Tensor | None:
        if self.count >= len(self.keys) or chunk.key != self.keys[self.count] or chunk.offset != self._filled:
            raise PageCorrupt(f"out-of-order chunk for page {self.count}")
        if self._filled == 0:
            if chunk.page_bytes != self.page_bytes:
                raise PageCorrupt(f"page {self.count} has {chunk.page_bytes} bytes, the layout needs {self.page_bytes}")
            if not self.reuse:
                self._buf = torch.empty(self.page_bytes, dtype=torch.uint8)
            self._expect = chunk.checksum
        end = self._filled + len(chunk.data)
        if end > self.page_bytes:
            raise PageCorrupt(f"page {self.count} got more than its {self.page_bytes} bytes")
        view = self._buf.numpy()
        view[self._filled : end] = memoryview(chunk.data)
        self._filled = end
        if end < self.page_bytes:
            return None
        if checksum(view) != self._expect:
            raise PageCorrupt(f"page {self.count} failed its checksum in transit")
        self._filled = 0
        self.count += 1
        return self._buf
