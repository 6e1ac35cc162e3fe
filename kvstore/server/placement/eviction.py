"""Which host page goes first under pressure: queue-aware segmented LRU.

More: kvstore/server/placement/README.md (### eviction.py).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable

from kvstore.server.placement.chains import PrefixLinks, TailFirst, walks_from

LEANED_FLOOR = 0.5  # of protected's share: a put being written takes reused pages down to it before its own


class HostResidency:
    """Eviction order of the pages in the host tier. Not thread-safe (owner's lock)."""

    def __init__(self, segmented: bool = True, protected_share: float = 0.8, ghost_pages: int = 1 << 16) -> None:
        self.segmented = segmented
        self.protected_share = protected_share
        self.lru: OrderedDict[bytes, None] = OrderedDict()        # unhinted probation, oldest first
        self.protected: OrderedDict[bytes, None] = OrderedDict()  # unhinted, used again
        self.hinted: set[bytes] = set()                           # resident and hinted
        self.hints: dict[bytes, list[float]] = {}                 # key -> heap of announced uses (etas)
        self.depth: dict[bytes, int] = {}                         # hinted key -> its page index in the prefix
        self.due: list[tuple[float, bytes]] = []                  # heap of (eta, key), one per announced use
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()     # recently evicted
        self.ghost_pages = ghost_pages
        self.orphans: OrderedDict[bytes, None] = OrderedDict()    # unhinted, predecessor gone: no use
        self.chains = TailFirst()  # predecessor links; the victim is the deepest page of the LRU page's chain

    @property
    def links(self) -> PrefixLinks:
        return self.chains.links

    def __contains__(self, key: bytes) -> bool:
        return key in self.lru or key in self.protected or key in self.hinted or key in self.orphans

    def _unannounced(self, key: bytes) -> bool:
        return key in self.lru or key in self.protected or key in self.orphans

    def _protect(self, key: bytes) -> None:
        self.protected[key] = None
        self.protected.move_to_end(key)
        resident = len(self.lru) + len(self.protected) + len(self.hinted) + len(self.orphans)
        while len(self.protected) > self.protected_share * resident:
            old, _ = self.protected.popitem(last=False)
            self.lru[old] = None  # back to probation, as its most recent entry

    def next_use(self, key: bytes) -> float | None:
        etas = self.hints.get(key)
        return etas[0] if etas else None

    def add(self, key: bytes, parent: bytes | None = None) -> None:
        """``key`` is stored; ``parent``: the page before it in its prefix, when known."""
        self.orphans.pop(key, None)
        if key in self.hints:
            self.hinted.add(key)
        elif self.segmented and self.ghosts.pop(key, False) is None:
            self._protect(key)
        else:
            self.lru[key] = None
            self.lru.move_to_end(key)
        for child in self.links.after(key):  # they were waiting for it (a batch committed out of order)
            if self.orphans.pop(child, False) is None:
                self.lru[child] = None
        if parent is not None:
            self.chains.link(key, parent)
            if parent not in self:
                self._orphan(key)

    def _orphan(self, key: bytes) -> None:
        if key in self.lru or key in self.protected:
            self.lru.pop(key, None)
            self.protected.pop(key, None)
            self.orphans[key] = None

    def touch(self, key: bytes) -> None:
        if key in self.lru:
            if self.segmented:
                del self.lru[key]
                self._protect(key)
            else:
                self.lru.move_to_end(key)
        elif key in self.protected:
            self.protected.move_to_end(key)

    def remove(self, key: bytes, evicted: bool = False) -> None:
        self.lru.pop(key, None)
        self.protected.pop(key, None)
        self.hinted.discard(key)
        self.orphans.pop(key, None)
        for child in self.chains.removed(key, evicted):
            self._orphan(child)
        if evicted and self.segmented:
            self.ghosts[key] = None
            if len(self.ghosts) > self.ghost_pages:
                self.ghosts.popitem(last=False)

    def hint(self, key: bytes, eta: float, depth: int = 0) -> None:
        """A queued request needs ``key``, its page ``depth`` (index in the prefix), at ``eta``."""
        heapq.heappush(self.hints.setdefault(key, []), eta)
        heapq.heappush(self.due, (eta, key))
        self.depth[key] = depth
        if self._unannounced(key):
            self.lru.pop(key, None)
            self.protected.pop(key, None)
            self.orphans.pop(key, None)
            self.hinted.add(key)
            self.chains.changed(key)  # a walk no longer follows it

    def consume(self, key: bytes, now: float) -> None:
        """A use of ``key`` happened: announced uses up to now are fulfilled."""
        etas = self.hints.get(key)
        if not etas:
            return
        while etas and etas[0] <= now + 1e-6:
            heapq.heappop(etas)
        if not etas:
            self._unhint(key)

    def _unhint(self, key: bytes) -> None:
        del self.hints[key]
        self.depth.pop(key, None)
        if key in self.hinted:
            self.hinted.discard(key)
            self.chains.changed(key, followed=True)  # a walk follows it again
            if self.segmented:
                self._protect(key)  # it was used, as announced
            else:
                self.lru[key] = None

    def expire(self, now: float, grace_s: float) -> None:
        """Forgets announced uses more than ``grace_s`` past; a key stays hinted while any
        use of it is still ahead. Pops only what expired (and ``due`` entries of uses
        fulfilled meanwhile, each once)."""
        while self.due and self.due[0][0] + grace_s < now:
            _, key = heapq.heappop(self.due)
            etas = self.hints.get(key)
            if not etas:
                continue  # fulfilled (consumed) already
            while etas and etas[0] + grace_s < now:
                heapq.heappop(etas)
            if not etas:
                self._unhint(key)

    def _passes(self, pinned: Container[bytes]) -> list[tuple[Iterable[bytes], Container[bytes]]]:
        """The unannounced pages' segments in the order they give up chains, each with what it
        passes over. Orphans, over the pins alone (``_loose``); probation; protected while it
        holds more than ``LEANED_FLOOR`` of its share of the resident pages; then the chains open
        allocations only lean on (``Leases.kept``: a put's, walked again over the pins alone);
        protected. A put keeps its head, and a one-shot put pushes reused pages no lower than
        that floor (DESIGN §6), a demoter's round too: the pages it named already (``moving``)
        count as gone (the walk never names them; it walks through them to what a put committed
        after them, chains.py). Without leaning: orphans, probation, protected."""
        loose = _loose(pinned)
        if loose is pinned:
            return [(self.orphans, pinned), (self.lru, pinned), (self.protected, pinned)]
        moving = [k for k in getattr(pinned, "moving", ()) if k in self]  # a round's named pages count as gone
        resident = len(self.lru) + len(self.protected) + len(self.hinted) + len(self.orphans) - len(moving)
        protected = len(self.protected) - sum(k in self.protected for k in moving)
        over = self.segmented and protected > LEANED_FLOOR * self.protected_share * resident
        leaned = [(self.lru, loose)] if over else [(self.lru, loose), (self.protected, pinned)]
        return [(self.orphans, loose), (self.lru, pinned), *([(self.protected, pinned)] if over else []), *leaned,
                (self.protected, loose)]

    def priorities(self, pinned: Container[bytes], hinted_share: int | None = None) -> dict[bytes, tuple[int, float, int]]:
        """The order as one priority function (DESIGN §6): each page that may go now with its
        sort key, the least first. Unannounced pages by their chain's place in the segments of
        ``_passes``, in its order (``TailFirst.ends``); hinted ones by their next announced use,
        furthest first, then the deepest; hinted ones after the others unless they hold more
        than ``hinted_share`` pages. ``victim`` names a page of the least priority without
        computing them all; this is the slow definition it is held to (tests), not a path."""
        over = hinted_share is not None and len(self.hinted) > hinted_share
        ranked: dict[bytes, tuple[int, float, int]] = {}
        offset = 0
        for segment, kept in self._passes(pinned):
            order = list(segment)
            for position, last in self.chains.ends(order, self._unannounced, kept):
                ranked.setdefault(last, (int(over), float(offset + position), 0))
            offset += len(order)
        loose = _loose(pinned)
        for key in self.hinted:
            if key not in loose:
                ranked[key] = (int(not over), -self.hints[key][0], -self.depth[key])
        return ranked

    def victim(self, pinned: Container[bytes], hinted_share: int | None = None) -> bytes | None:
        """A page of the least ``priorities`` (None: every page is pinned or keeps a pinned one)."""
        passes = self._passes(pinned)
        if hinted_share is None or len(self.hinted) <= hinted_share:
            for segment, kept in passes:
                last = self.chains.victim(segment, self._unannounced, kept)
                if last is not None:
                    return last
        loose = _loose(pinned)
        best, best_use = None, (-1.0, -1)
        for key in self.hinted:
            use = (self.hints[key][0], self.depth[key])
            if key not in loose and use > best_use:
                best, best_use = key, use
        if best is None:
            blocked: dict[int, set[bytes]] = {}  # chains a kept page keeps, per what is kept
            return next((last for segment, kept in passes for k in segment
                         if walks_from(k, kept) and (last := self.links.deepest(k, self._unannounced, kept, blocked.setdefault(id(kept), set())))),
                        None)
        return best


def _loose(pinned: Container[bytes]) -> Container[bytes]:
    """The pins alone, not what open allocations lean on (``Leases.kept``): what an orphan's
    chain passes over (its head is gone, so keeping its end for a put's next batch keeps
    nothing findable: that batch's commit counts none of it), what a leaned chain is walked
    over in its turn (``_passes``), and what a hinted page is (they go last, DESIGN §6)."""
    return getattr(pinned, "pins", pinned)
