"""Reading: leasing a stored prefix readable in the landing tier, prefetching what queued
requests will need, and scrubbing lower-tier pages in the background."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.directory import Directory
from kvstore.errors import PageCorrupt, TierFull
from kvstore.page import LayoutDesc, PageHeader
from kvstore.pagecopy import checksum_released
from kvstore.server.metrics import Metrics
from kvstore.server.placement.housekeeping import Housekeeper
from kvstore.server.placement.moves import Mover
from kvstore.server.placement.residence import LANDING
from kvstore.tiers.base import ReadResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcquiredPage:
    """A leased page: its landing slot stays valid until the lease goes."""

    key: bytes
    slot: int
    header: PageHeader

    @property
    def checksum(self) -> int:
        return self.header.checksum


class Reader:
    def __init__(self, keeper: Housekeeper, moves: Mover, directory: Directory, node: str, metrics: Metrics,
                 layout_of: Callable[[bytes], LayoutDesc | None], owner_of: Callable[[bytes], str]) -> None:
        self.keeper = keeper
        self.residence = keeper.residence
        self.leases = keeper.leases
        self.landing = keeper.residence.landing
        self.tiers = keeper.residence.tiers
        self.moves = moves
        self.directory = directory
        self.node = node
        self.metrics = metrics
        self.layout_of = layout_of
        self.owner_of = owner_of  # namespace id -> the owner of the arena its pages are read up into
        self.unchecked = moves.unchecked  # landed from other nodes unhashed (the cluster's remote tier records them)
        self._scrub_queue: list[tuple[int, bytes]] = []
        self._scratch = threading.local()

    def acquire(self, namespace_id: bytes, keys: list[bytes], ttl_ms: int, learn: bool = True,
                owner: str = "") -> tuple[bytes, list[AcquiredPage]]:
        """Leases the longest contiguous prefix of ``keys`` and makes it readable in the
        landing tier, reading pages held only below into it. A page that fails its check ends
        the prefix (and is quarantined). When the landing tier cannot take more pages the
        prefix ends early; the caller asks again for the rest.

        Reads run outside the lock: pages read up get a reserved landing slot and a pin
        first, and are committed there (published) once read and verified.
        """
        ttl_ms = self.leases.lease_ttl_ms(ttl_ms)  # before any pin is taken
        landing, hit, miss = self.landing.name, self.metrics.hits, self.metrics.misses
        pages: list[AcquiredPage] = []
        read_up: list[tuple[int, bytes, int]] = []  # (lower tier, key, landing slot)
        at: list[int] = []  # where each of read_up is in pages
        touched: list[bytes] = []  # landing hits, touched once the prefix is known
        # before the lock: it may be made now; only for a namespace with a page here (DESIGN §11: an unbound one's
        # reader, served nothing, makes no arena for the unbound owner, reserved in full and mapped by nobody)
        first = self.directory.get(keys[0]) if keys else None
        arena = self.landing.part(self.owner_of(namespace_id)) if first is not None and first.namespace_id == namespace_id else None
        with self.keeper.critical():
            self.keeper.reap()
            generation = self.directory.generation(namespace_id)  # a page of an older one is never served
            for key in keys:
                entry = self.directory.get(key)
                if entry is None or entry.namespace_id != namespace_id or arena is None or not self.residence.stored(key):
                    miss.labels(landing).inc()
                    break
                if learn:
                    self.keeper.learn(key)
                if self.residence.has(key, LANDING):
                    found = arena.find(key)  # in its owner's arena, where this reader maps it
                    if found is None or found[1].generation != generation:
                        break
                    touched.append(key)
                    hit.labels(landing).inc()
                    self.leases.pin([key])
                    pages.append(AcquiredPage(key, *found))
                    continue
                miss.labels(landing).inc()
                tier = self.residence.holder(key)
                part = self.residence.part(key, tier) if tier is not None else None
                found = part.find(key) if part is not None else None
                if tier is not None and found is None:  # held with no header: its index entry failed its check
                    self._quarantine(key, tier, "its index entry failed its check")  # else promised for ever
                if tier is None or found is None or found[1].generation != generation:
                    break
                header = found[1]
                self.leases.pin([key])  # keeps the lower copy while we make room and read it
                slot = self.moves.make_room(header.payload_bytes, arena)
                if slot is None:
                    self.keeper.unpin([key])
                    if pages:
                        break  # serve what is pinned; the caller asks again for the rest
                    raise TierFull(f"{landing} tier is full and every page in it is leased; "
                                   f"cannot promote from {self.tiers[tier].name}")
                read_up.append((tier, key, slot))
                at.append(len(pages))
                pages.append(AcquiredPage(key, slot, header))
            for key in reversed(touched):  # deepest first: the head of the prefix ends the most recent
                self.residence.orders[LANDING].touch(key)
        result = self.moves.read_up(read_up)
        with self.keeper.critical():
            return self._lease(pages, read_up, at, result.num_read, result.reason, ttl_ms, owner)

    def _lease(self, pages: list[AcquiredPage], read_up: list[tuple[int, bytes, int]], at: list[int], num_read: int,
               reason: str, ttl_ms: int, owner: str) -> tuple[bytes, list[AcquiredPage]]:
        """Lock held: commits what was read up, cuts the prefix at the first failure, leases it."""
        source = {page: j for j, page in enumerate(at)}  # index in pages -> index in read_up
        cut, bad_tier = len(pages), 0
        for i, page in enumerate(pages):
            if i not in source:
                continue
            tier, _, slot = read_up[source[i]]
            arena = self.landing.at(slot)  # the owner's, where the page was read up into
            if source[i] >= num_read and cut == len(pages):
                cut, bad_tier = i, tier
            if i >= cut:
                arena.unreserve(slot)
                continue
            if self.residence.has(page.key, LANDING):  # read up concurrently by another reader
                arena.unreserve(slot)
                pages[i] = AcquiredPage(page.key, arena.find(page.key)[0], page.header)  # type: ignore[index]
                continue
            record = (page.key, self.node, self.landing.name, page.header.payload_bytes)
            if page.key not in self.directory.publish_listed(page.header.namespace_id, [record], page.header.generation):
                arena.unreserve(slot)  # removed while we read it: not resurrected
                cut, reason = i, ""
                continue
            arena.commit([(slot, page.header)], [pages[i - 1].key if i else None])
            name = self.tiers[tier].name
            self.residence.orders[tier].touch(page.key)
            self.metrics.hits.labels(name).inc()
            self.metrics.bytes_out.labels(name).inc(page.header.payload_bytes)
            self.metrics.promotions.labels(name).inc()
        if cut < len(pages):
            bad = pages[cut].key
            # (the copy read, not one that replaced it meanwhile)
            part = self.residence.part(bad, bad_tier) if reason and bad_tier and self.residence.has(bad, bad_tier) else None
            held = part.find(bad) if part is not None else None
            if held is not None and held[1] == pages[cut].header:
                self._quarantine(bad, bad_tier, reason)
            self.keeper.unpin([p.key for p in pages[cut:]])
            pages = pages[:cut]
        for page in pages:
            self.metrics.bytes_out.labels(self.landing.name).inc(page.header.payload_bytes)
        keys = [p.key for p in pages]
        ident, _ = self.leases.lease(keys, ttl_ms, owner)
        self.keeper.unpin(keys)  # the lease holds them now
        return ident, pages

    def _quarantine(self, key: bytes, tier: int, reason: str) -> None:
        """Lock held: a lower-tier copy failed a check."""
        name = self.tiers[tier].name
        self.residence.quarantine(key, tier, reason)
        self.metrics.quarantined.labels(name).inc()
        self.directory.remove(key, self.node, name)

    def hint(self, namespace_id: bytes, keys: list[bytes], eta_s: float, prefetch: bool = True) -> bool:
        """A queued request will need ``keys`` in about ``eta_s`` seconds.

        Eviction learns the announced use (hinted pages go last, furthest use first). Pages
        held only below are read into the landing tier ahead of use if prefetch space is
        left within the hint share; the space is a reservation: when it is taken, nothing is
        read and False comes back at once, so the engine recomputes instead of waiting.
        """
        return self.hint_entries(namespace_id, [(keys, eta_s)], prefetch)[0]

    def hint_entries(self, namespace_id: bytes, entries: list[tuple[list[bytes], float]], prefetch: bool = True) -> list[bool]:
        """``hint`` for each (keys, eta_s) entry, announced all or none: LimitExceeded, with
        nothing announced, when together they would pass --max-hints."""
        order = self.residence.landing_orders.of(self.landing.part(self.owner_of(namespace_id)).owner)  # made now at its first use
        with self.keeper.critical():
            self.keeper.reap()
            order.check_hints(sum(len(keys) for keys, _ in entries))
            now = self.keeper.clock()
            for keys, eta_s in entries:
                order.hint(keys, now + eta_s)
        return [self._prefetch(namespace_id, keys, prefetch) for keys, _ in entries]

    def _prefetch(self, namespace_id: bytes, keys: list[bytes], prefetch: bool) -> bool:
        order = self.residence.landing_orders.of(self.landing.part(self.owner_of(namespace_id)).owner)
        with self.keeper.critical():
            stored = self.directory.prefix_length(namespace_id, keys)
            todo = [k for k in keys[:stored] if not self.residence.has(k, LANDING)] if prefetch else []
            layout = self.layout_of(namespace_id)
            if todo and (layout is None or not order.hint_room(len(todo), layout.page_bytes)):
                self.metrics.hints.labels("refused").inc(len(keys))
                return False
            self.metrics.hints.labels("reserved").inc(len(keys))
        if todo:
            try:
                ident, _ = self.acquire(namespace_id, todo, 0, learn=False)
            except TierFull:  # every page in the arena is leased: no room to read ahead, as when the share is taken
                return False
            with self.keeper.critical():
                self.residence.released(self.leases.release(ident) or [])
        return True

    def scrub_one(self) -> bool | None:
        """Verifies the next lower-tier page (round robin) against its checksum, outside
        the lock; a page that fails is quarantined. None when there is nothing to scrub."""
        with self.keeper.critical():
            if not self._scrub_queue:
                self._scrub_queue = [(i, key) for i in range(1, len(self.tiers)) for key in self.tiers[i].stored_keys()]
            found = None
            while self._scrub_queue:
                tier, key = self._scrub_queue.pop()
                if (part := self.residence.part(key, tier)) is not None and self.residence.has(key, tier):
                    found = (tier, key, part.find(key))
                    break
            if found is None:
                return None
            tier, key, held = found  # None: its index entry is damaged, which the read reports
            slot, header = held if held is not None else (None, None)
            self.leases.pin([key], move=True)
        return self._check(tier, key, slot, header, "scrub")

    def quarantine_landing(self, header: PageHeader, reason: str, slot: int | None = None) -> None:
        """A reader found the landing copy of a page damaged: it is dropped (``Mover.quarantine_landing``,
        which also has the node it was fetched from unhashed check its own), and so is any lower copy
        it was read up from that fails its check too."""
        self.moves.quarantine_landing(header, reason, slot)
        self.check_below(header.key)

    def check_held(self, namespace_id: bytes, keys: list[bytes], noted_only: bool = False) -> None:
        """Checks the landing copies of ``keys`` held here in place, for a copy that may become
        the only one (a replica, a migration's: DESIGN §4), which counts a page held here only
        once its bytes hold: it may have landed unhashed (a fill, a handoff). A damaged one is
        quarantined (its source asked), so the caller fetches it again, checked. ``noted_only``:
        only those ``unchecked`` remembers (a fill that landed while the caller's copy did)."""
        for key in keys:
            if noted_only and not self.unchecked.noted(key):
                continue
            with self.keeper.critical():
                part = self.landing.part_of(key) if self.residence.has(key, LANDING) else None
                held = part.find(key) if part is not None else None
                if part is None or held is None or held[1].namespace_id != namespace_id:
                    continue
                self.leases.pin([key], move=True)
            slot, header = held
            try:
                header.verify_payload(part.view(slot, header.payload_bytes), header.payload_bytes, checksum_released)
                reason = ""
            except PageCorrupt as exc:
                reason = str(exc)
            finally:
                with self.keeper.critical():
                    self.residence.released(self.leases.unpin([key], move=True))
            if reason:
                self.quarantine_landing(header, f"held here for a checked copy: {reason}", slot)
            else:
                self.unchecked.forget([key])

    def check_below(self, key: bytes) -> None:
        """The landing copy of ``key`` failed a check. Lower copies are read up unchecked (the
        reader checks the bytes: DESIGN §4), so the damage may have come from one of them:
        each is checked now and quarantined if it fails, dropped where the damage is instead
        of read up again for the next reader."""
        for tier in range(1, len(self.tiers)):
            with self.keeper.critical():
                part = self.residence.part(key, tier)
                if part is None or not self.residence.has(key, tier):
                    continue
                held = part.find(key)
                slot, header = held if held is not None else (None, None)
                self.leases.pin([key], move=True)
            self._check(tier, key, slot, header, "after its copy read up failed a check")

    def _check(self, tier: int, key: bytes, slot: int | None, header: PageHeader | None, why: str) -> bool:
        """Reads the copy of ``key`` in ``tier`` (pinned by the caller for this, with the
        pin of a move, which is dropped here) and verifies it; quarantines it if it fails and
        is still that copy. False when it failed."""
        size = header.payload_bytes if header is not None else 0
        buf = getattr(self._scratch, "buf", None)  # per thread: the scrubber and a reader's report may check at once
        if buf is None or len(buf) < size + 4096:
            buf = self._scratch.buf = bytearray(size + 4096)
        try:
            part = self.residence.part(key, tier)  # None: gone meanwhile, a miss
            result = part.read_into([(key, memoryview(buf))]) if part is not None else ReadResult(0)
            reason = result.reason if result.num_read == 0 else ""
        except OSError as exc:
            reason = ""  # an I/O error is not evidence of bad bytes; retried next round
            logger.warning("%s: read of %s failed: %s", why, key.hex(), exc)
        with self.keeper.critical():
            self.residence.released(self.leases.unpin([key], move=True))
            self.metrics.scrubbed.inc()
            part = self.residence.part(key, tier)
            if reason and part is not None and self.residence.has(key, tier) and (part.find(key) or (None,))[0] == slot:
                self._quarantine(key, tier, f"{why}: {reason}")
        return not reason
