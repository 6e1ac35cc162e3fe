"""Each tier's eviction order, as the placement core asks it (``tier.order``; DESIGN §6).

A tier stores pages (base.Tier); which page goes next is a separate question, answered by
an order object (base.EvictionOrder: ``touch``, ``victim``; the landing tier's also takes
queue hints, base.LandingOrder). The tier keeps its order's bookkeeping in step with what it
stores (a commit adds, a delete removes, under the tier's own lock); the core asks the order
only: who goes next, a page was used, a page will be used. Every method here takes the
tier's lock and none blocks on I/O.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container
from typing import Any

from kvstore.config import HostTierConfig
from kvstore.errors import LimitExceeded
from kvstore.tiers.chains import TailFirst
from kvstore.tiers.eviction import HostResidency
from kvstore.tiers.owner_parts import UNOWNED


class LruOrder:
    """Least recently used first (an hbm pool): ``keys`` in that order, kept by the tier."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.keys: OrderedDict[bytes, None] = OrderedDict()  # least recently used first; the tier's lock

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self.keys:
                self.keys.move_to_end(key)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        with self._lock:
            return next((k for k in self.keys if k not in pinned), None)


class TailFirstOrder:
    """The SSD tier's order: its index in least-recently-used order, given up tail first
    (chains.py)."""

    def __init__(self, lock: threading.Lock, pages: OrderedDict[bytes, Any], chains: TailFirst) -> None:
        self._lock = lock
        self._pages = pages  # the tier's index, least recently used first
        self.chains = chains

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._pages:
                self._pages.move_to_end(key)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        with self._lock:
            return self.chains.victim(self._pages, self._pages.__contains__, pinned)


class HostOrder:
    """One host arena's order: queue-aware segmented LRU (eviction.py), with the hints the
    engine's scheduler announces, bounded by ``config.max_hints`` and ``config.hint_share``
    of ``capacity_bytes``."""

    def __init__(self, lock: threading.Lock, config: HostTierConfig, capacity_bytes: int) -> None:
        self._lock = lock
        self.config = config
        self._capacity = capacity_bytes
        self.residency = HostResidency(segmented=config.eviction == "slru")  # the tier's lock

    def touch(self, key: bytes) -> None:
        with self._lock:
            self.residency.touch(key)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        with self._lock:
            return self.residency.victim(pinned, self._hint_share(page_bytes))

    def parent(self, key: bytes) -> bytes | None:
        with self._lock:
            return self.residency.links.parent.get(key)

    def hint(self, keys: list[bytes], eta: float) -> None:
        """Raises LimitExceeded, holding nothing new, when the announced uses held would pass
        ``config.max_hints`` (every announced use costs memory until its eta plus grace)."""
        with self._lock:
            self._check(len(keys))
            for depth, key in enumerate(keys):
                self.residency.hint(key, eta, depth)

    def check_hints(self, num_keys: int) -> None:
        """Raises LimitExceeded when ``num_keys`` more announced uses would pass
        ``config.max_hints`` (a caller announcing several batches checks them whole first)."""
        with self._lock:
            self._check(num_keys)

    def _check(self, num_keys: int) -> None:
        held = len(self.residency.due)
        if held + num_keys > self.config.max_hints:
            raise LimitExceeded(f"{held} hinted keys are held, {num_keys} more would pass the limit of "
                                f"{self.config.max_hints} (--max-hints); nothing was hinted")

    def hint_room(self, num_pages: int, page_bytes: int) -> bool:
        with self._lock:
            return len(self.residency.hinted) + num_pages <= self._hint_share(page_bytes)

    def num_hinted(self) -> int:
        """Keys with an announced use still ahead (resident or not)."""
        with self._lock:
            return len(self.residency.hints)

    def used(self, key: bytes, now: float) -> None:
        with self._lock:
            self.residency.consume(key, now)

    def expire_hints(self, now: float) -> None:
        with self._lock:
            self.residency.expire(now, self.config.hint_grace_s)

    def _hint_share(self, page_bytes: int) -> int:
        return int(self.config.hint_share * self._capacity // max(1, page_bytes))


class PartsOrder:
    """The order of a tier of per-owner parts (owner_parts.py) as a whole: a key's calls go
    to the order of the part that holds it, a victim comes from the parts in ``ranked``
    order (the core makes room in one owner's part with ``part(owner).order``; this answers
    a caller that names none), hints are announced in the part without an owner and
    fulfilled and expired in all."""

    def __init__(self, tier: Any, ranked: Callable[[list[Any]], list[Any]]) -> None:
        self._tier = tier  # an OwnerParts
        self._ranked = ranked

    def touch(self, key: bytes) -> None:
        part = self._tier.holder(key)
        if part is not None:
            part.order.touch(key)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        return next((v for part in self._ranked(self._tier.parts())
                     if (v := part.order.victim(pinned, page_bytes)) is not None), None)

    def parent(self, key: bytes) -> bytes | None:
        part = self._tier.holder(key)
        return part.order.parent(key) if part is not None else None

    def hint(self, keys: list[bytes], eta: float) -> None:
        self._tier.part(UNOWNED).order.hint(keys, eta)

    def check_hints(self, num_keys: int) -> None:
        self._tier.part(UNOWNED).order.check_hints(num_keys)

    def hint_room(self, num_pages: int, page_bytes: int) -> bool:
        return bool(self._tier.part(UNOWNED).order.hint_room(num_pages, page_bytes))

    def num_hinted(self) -> int:
        return sum(part.order.num_hinted() for part in self._tier.parts())

    def used(self, key: bytes, now: float) -> None:
        for part in self._tier.parts():
            part.order.used(key, now)

    def expire_hints(self, now: float) -> None:
        for part in self._tier.parts():
            part.order.expire_hints(now)
