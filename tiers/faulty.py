"""A tier that fails on purpose, for tests: errors, short reads, corrupt bytes and delays.

More: tiers/README.md (### faulty.py).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence

from kvstore.page import PageHeader
from kvstore.tiers.base import ReadResult, Tier, TierWrapper


class FaultyTier(TierWrapper):
    def __init__(self, inner: Tier, seed: int, error_rate: float = 0.0, short_read_rate: float = 0.0,
                 corrupt_rate: float = 0.0, delay_s: float = 0.0) -> None:
        super().__init__(inner)
        self.seed = seed
        self.error_rate = error_rate
        self.short_read_rate = short_read_rate
        self.corrupt_rate = corrupt_rate
        self.delay_s = delay_s
        self.injected: Counter[str] = Counter()
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"FaultyTier({self.inner.name}, seed={self.seed}, error_rate={self.error_rate}, "
                f"short_read_rate={self.short_read_rate}, corrupt_rate={self.corrupt_rate}, delay_s={self.delay_s})")

    def _draw(self, rate: float, fault: str) -> bool:
        if rate <= 0:
            return False
        with self._lock:
            hit = self._random.random() < rate
            if hit:
                self.injected[fault] += 1
        return hit

    def _io(self, what: str) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        if self._draw(self.error_rate, "error"):
            raise OSError(f"injected I/O error in {self.inner.name}.{what} (FaultyTier seed {self.seed})")

    def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        """Draws each page's faults in turn; an error cuts the batch at its page, after the
        pages before it were written (an I/O error in the middle of a batch)."""
        done: list[tuple[int, PageHeader, memoryview]] = []
        try:
            for slot, header, payload in pages:
                self._io("write")
                done.append((slot, header, self._damaged(header, payload)))
        finally:
            if done:
                self.inner.write(done)

    def _damaged(self, header: PageHeader, payload: memoryview) -> memoryview:
        """The payload, or (``corrupt_rate``) a copy of it with one byte flipped."""
        if header.payload_bytes and self._draw(self.corrupt_rate, "corrupt"):
            damaged = bytearray(payload[: header.payload_bytes])
            with self._lock:
                at = self._random.randrange(len(damaged))
            damaged[at] ^= 0x5A
            return memoryview(damaged)
        return payload

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        self._io("commit")
        self.inner.commit(pages, parents)

    def read_into(self, pages: list[tuple[bytes, memoryview]], verify: bool = True) -> ReadResult:
        self._io("read_into")
        if pages and self._draw(self.short_read_rate, "short_read"):
            with self._lock:
                keep = self._random.randrange(len(pages))
            result = self.inner.read_into(pages[:keep], verify)
            return result if result.num_read < keep else ReadResult(keep)
        return self.inner.read_into(pages, verify)

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        if self._draw(self.error_rate, "error"):
            raise OSError(f"injected I/O error in {self.inner.name}.delete (FaultyTier seed {self.seed})")
        return self.inner.delete(keys, evicted)
