"""Which host page goes first under pressure: queue-aware LRU.

Pages nobody announced go first, least recently used first. Pages the engine's scheduler
hinted (a queued request will need them at ``eta``) go only when nothing else can, and
then the one whose use is furthest away (Belady's rule, with the queue as the oracle).
A hint ends when the page is used or when its eta has long passed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container


class HostResidency:
    """Eviction order of the pages in the host tier. Not thread-safe (owner's lock)."""

    def __init__(self) -> None:
        self.lru: OrderedDict[bytes, None] = OrderedDict()  # unhinted, oldest first
        self.hinted: set[bytes] = set()                     # resident and hinted
        self.hints: dict[bytes, float] = {}                 # key -> eta (resident or not)

    def __contains__(self, key: bytes) -> bool:
        return key in self.lru or key in self.hinted

    def add(self, key: bytes) -> None:
        if key in self.hints:
            self.hinted.add(key)
        else:
            self.lru[key] = None
            self.lru.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self.lru.pop(key, None)
        self.hinted.discard(key)

    def hint(self, key: bytes, eta: float) -> None:
        self.hints[key] = min(eta, self.hints.get(key, eta))
        if key in self.lru:
            del self.lru[key]
            self.hinted.add(key)

    def consume(self, key: bytes) -> None:
        """The hinted use happened (or will not): back to plain LRU, most recent."""
        if self.hints.pop(key, None) is not None and key in self.hinted:
            self.hinted.discard(key)
            self.lru[key] = None

    def expire(self, now: float, grace_s: float) -> None:
        for key in [k for k, eta in self.hints.items() if eta + grace_s < now]:
            self.consume(key)

    def victim(self, pinned: Container[bytes]) -> bytes | None:
        for key in self.lru:
            if key not in pinned:
                return key
        best, best_eta = None, -1.0
        for key in self.hinted:
            eta = self.hints.get(key, 0.0)
            if key not in pinned and eta > best_eta:
                best, best_eta = key, eta
        return best
