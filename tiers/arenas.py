"""The landing tier of a server with tenants: one anonymous arena per tenant (issue 16).

Whoever maps an arena reads and writes every slot in it, so an arena is a trust domain; with
tenants each gets its own (a ``HostTier`` made with ``anonymous=True``: a 0600 memfd with no
name in any filesystem, handed to the tenant's clients as a file descriptor). The placement
core still sees one landing tier: a slot number says which arena it is in (arena ``i`` numbers
its slots from ``i << ARENA_BITS``), a key is in at most one arena (its namespace's owner's),
and what must happen in one tenant's arena (reserving a slot, choosing a victim, hints) is
asked of that arena, ``part(owner)``. An arena is made at its owner's first use, sized by
``size_of(owner)`` (the tenant's host_bytes quota, else --host-capacity), and lives as long
as the server: clients hold mappings of it. With hbm, each is page-locked as it is made
(``pins``, pinned.py) and unpinned before it is unmapped.

Thread-safety: every arena guards itself; the list of arenas only grows (under ``_lock``),
and a reader that iterates it without the lock sees a prefix of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container, Sequence
from dataclasses import replace

from kvstore.config import HostTierConfig
from kvstore.errors import ConfigError, TierFull
from kvstore.page import PageHeader
from kvstore.tiers.base import ArenaInfo, Quarantined, ReadResult, StoredPage, TierUsage, parent_links
from kvstore.tiers.host import HostTier
from kvstore.tiers.pinned import ArenaPins
from kvstore.tiers.slab import SlabAllocator

logger = logging.getLogger(__name__)

ARENA_BITS = 40  # an arena holds at most 1 TiB; slot >> ARENA_BITS is its arena
UNOWNED = ""  # the owner of pages no tenant owns (none are handed to any client)


def _fill(tier: HostTier) -> float:
    usage = tier.usage()
    return usage.used_bytes / usage.capacity_bytes if usage.capacity_bytes else 0.0


class TenantArenas:
    """A ``LandingTier`` over one arena per owner (see the module docstring)."""

    name = "host"

    def __init__(self, config: HostTierConfig, node: str, size_of: Callable[[str], int],
                 pins: ArenaPins | None = None) -> None:
        self.config = config
        self.pins = pins
        self.node = node
        self._size_of = size_of
        self._arenas: list[HostTier] = []
        self._by_owner: dict[str, HostTier] = {}
        self._lock = threading.Lock()
        self.arena = ArenaInfo("", 0, b"")  # no arena as a whole: each owner's is part(owner).arena
        self._slabs = SlabAllocator(0, config.slab_bytes, config.slab_bytes)  # answers ``fits`` alike for every arena

    # -- the arenas ----------------------------------------------------------------------

    def part(self, owner: str) -> HostTier:
        """``owner``'s arena, made now at its first use (ConfigError when the host cannot hold it)."""
        found = self._by_owner.get(owner)
        if found is not None:
            return found
        with self._lock:
            found = self._by_owner.get(owner)
            if found is None:
                slab = self.config.slab_bytes
                wanted = min(self._size_of(owner) or self.config.capacity_bytes, self.config.capacity_bytes)
                try:
                    found = HostTier(replace(self.config, capacity_bytes=-(-wanted // slab) * slab), self.node,
                                     base=len(self._arenas) << ARENA_BITS, anonymous=True)
                except ConfigError as exc:
                    raise TierFull(f"no arena for tenant {owner!r}: {exc}") from None
                if self.pins is not None:
                    self.pins.pin(found)
                self._arenas.append(found)
                self._by_owner[owner] = found
                logger.info("arena %d made for tenant %r", len(self._arenas) - 1, owner)
            return found

    def parts(self) -> list[HostTier]:
        return list(self._arenas)

    def _at(self, slot: int) -> HostTier:
        return self._arenas[slot >> ARENA_BITS]

    def _holder(self, key: bytes) -> HostTier | None:
        return next((arena for arena in list(self._arenas) if arena.contains(key)), None)

    # -- slots: in the arena their number names ------------------------------------------

    def reserve(self, payload_bytes: int) -> int | None:
        return self.part(UNOWNED).reserve(payload_bytes)

    def unreserve(self, slot: int) -> None:
        self._at(slot).unreserve(slot)

    def write(self, slot: int, header: PageHeader, payload: memoryview) -> None:
        self._at(slot).write(slot, header, payload)

    def write_many(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        for slot, header, payload in pages:
            self.write(slot, header, payload)

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        links = parent_links(parents, len(pages))
        for arena in self.parts():
            mine = [(page, parent) for page, parent in zip(pages, links) if self._at(page[0]) is arena]
            if mine:
                arena.commit([page for page, _ in mine], [parent for _, parent in mine])

    def view(self, slot: int, nbytes: int) -> memoryview:
        return self._at(slot).view(slot, nbytes)

    def offset(self, slot: int) -> int:
        return self._at(slot).offset(slot)

    def slot_bytes(self, slot: int) -> int:
        return self._at(slot).slot_bytes(slot)

    def fits(self, page_bytes: int) -> bool:
        return self._slabs.fits(page_bytes)

    # -- keys: in the arena that holds them ----------------------------------------------

    def read_into(self, pages: list[tuple[bytes, memoryview]]) -> ReadResult:
        for index, page in enumerate(pages):
            arena = self._holder(page[0])
            if arena is None:
                return ReadResult(index)
            result = arena.read_into([page])
            if result.num_read == 0:
                return ReadResult(index, result.reason)
        return ReadResult(len(pages))

    def contains(self, key: bytes) -> bool:
        return self._holder(key) is not None

    def header(self, key: bytes) -> PageHeader | None:
        arena = self._holder(key)
        return arena.header(key) if arena is not None else None

    def slot_of(self, key: bytes) -> int | None:
        arena = self._holder(key)
        return arena.slot_of(key) if arena is not None else None

    def parent(self, key: bytes) -> bytes | None:
        arena = self._holder(key)
        return arena.parent(key) if arena is not None else None

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        return sum(arena.delete(keys, evicted) for arena in self.parts())

    def detach(self, key: bytes) -> int | None:
        arena = self._holder(key)
        return arena.detach(key) if arena is not None else None

    def quarantine(self, key: bytes, reason: str) -> None:
        arena = self._holder(key)
        if arena is not None:
            arena.quarantine(key, reason)

    def quarantined(self) -> list[Quarantined]:
        return [q for arena in self.parts() for q in arena.quarantined()]

    def purge_quarantine(self) -> int:
        return sum(arena.purge_quarantine() for arena in self.parts())

    def touch(self, key: bytes) -> None:
        arena = self._holder(key)
        if arena is not None:
            arena.touch(key)

    def victim(self, pinned: Container[bytes], page_bytes: int) -> bytes | None:
        """The next victim of the fullest arena (room is made in one owner's arena with
        ``part(owner).victim``; this answers a caller that names none)."""
        for arena in sorted(self.parts(), key=_fill, reverse=True):
            found = arena.victim(pinned, page_bytes)
            if found is not None:
                return found
        return None

    def stored_keys(self) -> list[bytes]:
        return [key for arena in self.parts() for key in arena.stored_keys()]

    # -- hints: announced for one owner's arena, fulfilled and expired in all ------------

    def hint(self, keys: list[bytes], eta: float) -> None:
        self.part(UNOWNED).hint(keys, eta)

    def check_hints(self, num_keys: int) -> None:
        self.part(UNOWNED).check_hints(num_keys)

    def hint_room(self, num_pages: int, page_bytes: int) -> bool:
        return self.part(UNOWNED).hint_room(num_pages, page_bytes)

    def num_hinted(self) -> int:
        return sum(arena.num_hinted() for arena in self.parts())

    def used(self, key: bytes, now: float) -> None:
        for arena in self.parts():
            arena.used(key, now)

    def expire_hints(self, now: float) -> None:
        for arena in self.parts():
            arena.expire_hints(now)

    # -- index ---------------------------------------------------------------------------

    def recover(self) -> list[StoredPage]:
        return []  # RAM: what the last process held is gone

    def usage(self) -> TierUsage:
        usages = [arena.usage() for arena in self.parts()]
        return TierUsage(sum(u.num_pages for u in usages), sum(u.used_bytes for u in usages),
                         sum(u.capacity_bytes for u in usages))

    def close(self) -> None:
        for arena in self.parts():
            if self.pins is not None:
                self.pins.unpin(arena)
            arena.close()
