"""The landing tier of a server with tenants: one anonymous arena per tenant (DESIGN §11).

Whoever maps an arena reads and writes every slot in it, so an arena is a trust domain; with
tenants each gets its own (a ``HostTier`` made with ``anonymous=True``: a 0600 memfd with no
name in any filesystem, handed to the tenant's clients as a file descriptor). The placement
core still sees one landing tier: a slot number says which arena it is in (arena ``i`` numbers
its slots from ``i << ARENA_BITS``), a key is in at most one arena (its namespace's owner's),
and what must happen in one tenant's arena (reserving a slot) is asked of that arena,
``part(owner)``; each arena tells its own events (``events(owner, config)``: the core's
eviction order and hints of that arena). An arena is made at its owner's first use, sized by
``size_of(owner)`` (the tenant's host_bytes quota, else --host-capacity), and lives as long
as the server: clients hold mappings of it. With hbm, each is page-locked as it is made
(``pins``, pinned.py) and unpinned before it is unmapped.

The parts, their slot numbering and the per-key calls are owner_parts.py's (shared with the
hbm pools); what is the arenas' own is here: how one is made and pinned, views.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvstore.config import HostTierConfig
from kvstore.errors import ConfigError, TierFull
from kvstore.tiers.base import ArenaInfo, StoreEvents
from kvstore.tiers.host import HostTier
from kvstore.tiers.owner_parts import PART_BITS, OwnerParts
from kvstore.tiers.pinned import ArenaPins
from kvstore.tiers.slab import SlabAllocator

ARENA_BITS = PART_BITS  # slot >> ARENA_BITS is its arena


class TenantArenas(OwnerParts[HostTier]):
    """A ``LandingTier`` over one arena per owner (see the module docstring)."""

    name = "host"
    what = "arena"

    def __init__(self, config: HostTierConfig, node: str, size_of: Callable[[str], int],
                 pins: ArenaPins | None = None, events: Callable[[str, HostTierConfig], StoreEvents] | None = None) -> None:
        super().__init__()
        self.config = config
        self.pins = pins
        self.node = node
        self._size_of = size_of
        self._events = events  # (owner, the arena's config) -> the events of its arena
        self.arena = ArenaInfo("", 0, b"")  # no arena as a whole: each owner's is part(owner).arena
        self._slabs = SlabAllocator(0, config.slab_bytes, config.slab_bytes)  # answers ``fits`` alike for every arena

    def _make(self, owner: str, base: int) -> HostTier:
        """``owner``'s arena, sized by its quota (ConfigError when the host cannot hold it: TierFull)."""
        slab = self.config.slab_bytes
        wanted = min(self._size_of(owner) or self.config.capacity_bytes, self.config.capacity_bytes)
        config = replace(self.config, capacity_bytes=-(-wanted // slab) * slab)
        try:
            made = HostTier(config, self.node, base=base, anonymous=True, owner=owner,
                            events=self._events(owner, config) if self._events else None)
        except ConfigError as exc:
            raise TierFull(f"no arena for tenant {owner!r}: {exc}") from None
        if self.pins is not None:
            self.pins.pin(made)
        return made

    # -- what only arenas have -----------------------------------------------------------

    def view(self, slot: int, nbytes: int) -> memoryview:
        return self._at(slot).view(slot, nbytes)

    def slot_bytes(self, slot: int) -> int:
        return self._at(slot).slot_bytes(slot)

    def fits(self, page_bytes: int) -> bool:
        return self._slabs.fits(page_bytes)

    def detach(self, key: bytes) -> int | None:
        arena = self.holder(key)
        return arena.detach(key) if arena is not None else None

    def close(self) -> None:
        for arena in self.parts():
            if self.pins is not None:
                self.pins.unpin(arena)
            arena.close()
