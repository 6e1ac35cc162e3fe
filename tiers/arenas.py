"""The landing tier: one host arena, or one anonymous arena per owner (DESIGN §6, §11).

An arena is a trust domain (whoever maps it reads and writes every slot), so with ``per_owner`` each
owner gets its own: a 0600 memfd with no name (``HostTier(anonymous=True)``), handed to its clients
as a descriptor, made at the owner's first use, sized by ``size_of(owner)`` (else --host-capacity).
Otherwise (one owner for all: no auth, or --share-arena) there is one, in /dev/shm, made at start.
Each tells its own events (``events(owner, config)``: the core's order and hints of that arena); with
hbm each is page-locked as it is made (``pins``, pinned.py) and unpinned at close. Finding an arena by
owner, slot or key is owner_parts.py's (shared with the hbm pools).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvstore.config import HostTierConfig
from kvstore.errors import ConfigError, TierFull
from kvstore.tiers.base import UNOWNED, StoreEvents
from kvstore.tiers.host import HostTier
from kvstore.tiers.owner_parts import PART_BITS, OwnerParts, OwnerWords
from kvstore.tiers.pinned import ArenaPins

ARENA_BITS = PART_BITS  # slot >> ARENA_BITS is its arena


class OwnerArenas(OwnerParts[HostTier]):
    """The landing tier as a map of arenas by owner (see the module docstring); ``per_owner``:
    one per owner, else one for every owner."""

    what = "arena"

    def __init__(self, config: HostTierConfig, node: str, size_of: Callable[[str], int],
                 pins: ArenaPins | None = None, events: Callable[[str, HostTierConfig], StoreEvents] | None = None,
                 per_owner: bool = True, wrap: Callable[[HostTier], HostTier] | None = None,
                 words: OwnerWords | None = None) -> None:
        super().__init__("host", single=not per_owner, wrap=wrap, words=words)
        self.config = config
        self.pins = pins
        self.node = node
        self._size_of = size_of
        self._new_events = events  # (owner, the arena's config) -> the events of its arena
        self._pinned: list[HostTier] = []  # the arenas as made (a wrapper may stand for one in parts())
        if not per_owner:
            self.part(UNOWNED)  # made at start: a host that cannot hold it refuses the server at once

    def _make(self, owner: str, base: int) -> HostTier:
        """``owner``'s arena, sized by its quota (ConfigError when the host cannot hold it: TierFull);
        the one arena of every owner: --host-capacity, in /dev/shm (ConfigError refuses the start)."""
        if self.single:
            config = self.config
            made = HostTier(config, self.node, events=self._events(owner, self._new_events(owner, config) if self._new_events else None))
        else:
            slab = self.config.slab_bytes
            wanted = min(self._size_of(owner) or self.config.capacity_bytes, self.config.capacity_bytes)
            config = replace(self.config, capacity_bytes=-(-wanted // slab) * slab)
            try:
                made = HostTier(config, self.node, base=base, anonymous=True, owner=owner,
                                events=self._events(owner, self._new_events(owner, config) if self._new_events else None),
                                lower=f"--host-capacity or {self.words.sized_by}")
            except ConfigError as exc:
                raise TierFull(f"no arena for {self.words.named(owner)}: {exc}") from None
        if self.pins is not None:
            self.pins.pin(made)
            self._pinned.append(made)
        return made

    def close(self) -> None:
        for arena in self._pinned:
            self.pins.unpin(arena)  # type: ignore[union-attr]  # pinned only with pins
        super().close()
