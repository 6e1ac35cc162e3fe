"""Aligned staging buffers for SSD reads, shared by the server's threads."""

from __future__ import annotations

import mmap
import threading

from kvstore.tiers.slab import round_up


class StagingPool:
    """Pairs of aligned buffers for staged reads, shared by the server's threads: at most
    ``pairs`` exist (a reader waits for one), kept once made (first touch is slow), the
    most recently used handed out first."""

    def __init__(self, pairs: int = 4) -> None:
        self._free: list[tuple[memoryview, memoryview]] = []
        self._made = 0
        self._pairs = pairs
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> tuple[memoryview, memoryview]:
        with self._cond:
            while not self._free and self._made >= self._pairs:
                self._cond.wait()
            if self._free:
                pair = self._free.pop()
                if len(pair[0]) >= nbytes:
                    return pair
                self._made -= 1  # too small for this page size: replaced below
            self._made += 1
        size = round_up(max(nbytes, 4 << 20))
        return memoryview(mmap.mmap(-1, size)), memoryview(mmap.mmap(-1, size))

    def give(self, pair: tuple[memoryview, memoryview]) -> None:
        with self._cond:
            self._free.append(pair)
            self._cond.notify()
