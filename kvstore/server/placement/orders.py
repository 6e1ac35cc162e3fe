"""Which page of a tier goes next: the placement core's eviction orders (DESIGN §6).

A tier only stores (tiers/base.Tier); it tells what it stored and removed, as it happens and
under its own lock, to the ``StoreEvents`` it was made with, which is one of these orders.
The core asks the orders only: who goes next (``victim``: named, skipping pinned keys, left in
place), a page was used (``touch``), and for the landing tier's, a page will be used (queue
hints). Each order has its own lock and never blocks on I/O; none calls into its tier.

More: kvstore/server/placement/README.md (### orders.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container
from typing import Generic, Protocol, TypeVar

from kvstore.config import HostTierConfig
from kvstore.errors import LimitExceeded
from kvstore.server.placement.chains import TailFirst
from kvstore.server.placement.eviction import HostResidency
from kvstore.tiers.base import UNOWNED, LandingPart, LandingTier


class Order(Protocol):
    """What the core asks of any tier's order (and the tier tells it: ``stored``, ``removed``)."""

    def stored(self, key: bytes, parent: bytes | None) -> None: ...

    def removed(self, key: bytes, evicted: bool) -> None: ...

    def __contains__(self, key: object) -> bool: ...

    def touch(self, key: bytes) -> None:
        """A use of ``key`` (a key not held: nothing)."""
        ...

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        """The page to evict next to make room for one of ``page_bytes``, left in place
        (None: every page is pinned): one of the least ``priorities``."""
        ...

    def priorities(self, pinned: Container[bytes], page_bytes: int) -> dict[bytes, tuple[float, ...]]:
        """The order as one priority function: each page that may go now with its sort key,
        the least first (DESIGN §6). The slow definition ``victim`` is held to (tests)."""
        ...


class LruOrder:
    """Least recently used first (an hbm pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.keys: OrderedDict[bytes, None] = OrderedDict()  # least recently used first

    def stored(self, key: bytes, parent: bytes | None) -> None:
        with self._lock:
            self.keys[key] = None
            self.keys.move_to_end(key)

    def removed(self, key: bytes, evicted: bool) -> None:
        with self._lock:
            self.keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self.keys:
                self.keys.move_to_end(key)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        with self._lock:
            return next((k for k in self.keys if k not in pinned), None)

    def priorities(self, pinned: Container[bytes], page_bytes: int) -> dict[bytes, tuple[float, ...]]:
        with self._lock:
            return {k: (float(i),) for i, k in enumerate(self.keys) if k not in pinned}


class TailFirstOrder(LruOrder):
    """The SSD tier's order: least recently used first (a page counts as used when it is
    stored or read up), given up tail first (chains.TailFirst); ``stored`` with the page's
    parent when its writer named one (at start: in the index's order, with the links it kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.chains = TailFirst()

    def stored(self, key: bytes, parent: bytes | None) -> None:
        with self._lock:
            self.keys.pop(key, None)
            self.keys[key] = None
            if parent is not None:
                self.chains.link(key, parent)

    def removed(self, key: bytes, evicted: bool) -> None:
        with self._lock:
            self.keys.pop(key, None)
            self.chains.removed(key, evicted)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        with self._lock:
            return self.chains.victim(self.keys, self.keys.__contains__, pinned)

    def priorities(self, pinned: Container[bytes], page_bytes: int) -> dict[bytes, tuple[float, ...]]:
        with self._lock:
            ranked: dict[bytes, tuple[float, ...]] = {}
            for position, last in self.chains.ends(self.keys, self.keys.__contains__, pinned):
                ranked.setdefault(last, (float(position),))
            return ranked


class HostOrder:
    """One host arena's order: queue-aware segmented LRU (eviction.py), with the hints the
    engine's scheduler announces, bounded by ``config.max_hints`` and ``config.hint_share``
    of the arena's capacity."""

    def __init__(self, config: HostTierConfig) -> None:
        self._lock = threading.Lock()
        self.config = config
        self._capacity = config.capacity_bytes - config.capacity_bytes % config.slab_bytes  # the arena's slots
        self.residency = HostResidency(segmented=config.eviction == "slru")

    def stored(self, key: bytes, parent: bytes | None) -> None:
        with self._lock:
            self.residency.add(key, parent)

    def removed(self, key: bytes, evicted: bool) -> None:
        with self._lock:
            self.residency.remove(key, evicted)

    def __contains__(self, key: object) -> bool:
        return key in self.residency

    def touch(self, key: bytes) -> None:
        with self._lock:
            self.residency.touch(key)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        with self._lock:
            return self.residency.victim(pinned, self._hint_share(page_bytes))

    def priorities(self, pinned: Container[bytes], page_bytes: int) -> dict[bytes, tuple[float, ...]]:
        with self._lock:
            return dict(self.residency.priorities(pinned, self._hint_share(page_bytes)))

    def parent(self, key: bytes) -> bytes | None:
        """The page before ``key`` in its prefix, as its writer named it (a page written down takes it along)."""
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
        """Whether ``num_pages`` more hinted pages fit the share hints may hold."""
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


O = TypeVar("O", LruOrder, TailFirstOrder, HostOrder)


class Orders(Generic[O]):
    """One tier's orders, one per part by owner (``shared``: the tier is one part, whose order
    answers for every owner). ``make(owner, ...)`` is what the tier is given to make a part's
    order as it makes the part (its StoreEvents; the rest of the arguments go to the order's
    class: a host arena's config); the part's ``owner`` names it here."""

    def __init__(self, make: Callable[..., O], shared: bool = True) -> None:
        self._make = make
        self._shared = shared
        self._by_owner: dict[str, O] = {}
        self._lock = threading.Lock()

    def make(self, owner: str = UNOWNED, *args: object) -> O:
        """The order of ``owner``'s new part (a tier of one part: the one order)."""
        with self._lock:
            owner = UNOWNED if self._shared else owner
            found = self._by_owner.get(owner)
            if found is None:
                found = self._by_owner[owner] = self._make(*args)
            return found

    def of(self, owner: str = UNOWNED) -> O:
        """The order of ``owner``'s part (made with it)."""
        return self._by_owner[UNOWNED if self._shared else owner]

    def all(self) -> list[O]:
        """Every part's order, in the order the parts were made."""
        return list(self._by_owner.values())

    def holding(self, key: bytes) -> O | None:
        """The order of the part that holds ``key`` (None: none does)."""
        return next((order for order in self.all() if key in order), None)

    def touch(self, key: bytes) -> None:
        order = self.holding(key)
        if order is not None:
            order.touch(key)


class LandingOrders(Orders[HostOrder]):
    """The landing tier's orders (one per arena) and what the core asks of them as a whole:
    a key's of the arena that holds it, uses fulfilled and hints expired in every arena, the
    victim of the fullest arena first."""

    def parent(self, key: bytes) -> bytes | None:
        order = self.holding(key)
        return order.parent(key) if order is not None else None

    def used(self, key: bytes, now: float) -> None:
        for order in self.all():
            order.used(key, now)

    def expire_hints(self, now: float) -> None:
        for order in self.all():
            order.expire_hints(now)

    def num_hinted(self) -> int:
        return sum(order.num_hinted() for order in self.all())

    def victim(self, parts: list[LandingPart], pinned: Container[bytes], page_bytes: int) -> tuple[LandingPart, bytes] | None:
        """The first victim of ``parts``' orders, the fullest part first (a tier of arenas as a
        whole), with the part it is in."""
        return next(((part, v) for part in sorted(parts, key=_fill, reverse=True)
                     if (v := self.of(part.owner).victim(pinned, page_bytes)) is not None), None)


def _fill(tier: LandingTier) -> float:
    usage = tier.usage()
    return usage.used_bytes / usage.capacity_bytes if usage.capacity_bytes else 0.0
