"""The hbm tier as a map of device pools, one per owner: a pool follows the arenas' trust model.

Whoever maps a pool reads and writes every slot in it (a CUDA IPC mapping cannot be read-only), so
with ``per_owner`` each owner gets its own, holding only its namespaces' pages, handed only to it;
otherwise (one owner for all: no auth, or ``--share-arena``) there is one, made at start (a device
that cannot hold it refuses the server at once). An owner's is made at its first use, of
``--hbm-capacity`` bytes, and tells its own events (``events(owner)``: the core's order of that
pool). Finding a pool by owner, slot (``i << POOL_BITS``) or key is owner_parts.py's.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.config import HbmTierConfig
from kvstore.device_ops import DeviceOps, ops_for_pool
from kvstore.errors import TierFull
from kvstore.tiers.base import UNOWNED, StoreEvents
from kvstore.tiers.hbm import HbmTier, check_device
from kvstore.tiers.owner_parts import PART_BITS, OwnerParts, OwnerWords

POOL_BITS = PART_BITS  # slot >> POOL_BITS is its pool


class OwnerPools(OwnerParts[HbmTier]):
    """The upper tier as a map of hbm pools by owner (see the module docstring)."""

    what = "hbm pool"

    def __init__(self, config: HbmTierConfig, per_owner: bool, ops: DeviceOps | None = None,
                 events: Callable[[str], StoreEvents] | None = None, wrap: Callable[[HbmTier], HbmTier] | None = None,
                 words: OwnerWords | None = None) -> None:
        super().__init__("hbm", single=not per_owner, wrap=wrap, words=words)
        self._new_events = events  # owner -> the events of its pool
        self.config = config
        self.ops = ops or ops_for_pool(check_device(config))
        self.per_owner = per_owner
        if not per_owner:
            self.part(UNOWNED)  # made at start: a device that cannot hold it refuses the server at once

    def _make(self, owner: str, base: int) -> HbmTier:
        events = self._events(owner, self._new_events(owner) if self._new_events else None)
        try:
            return HbmTier(self.config, self.ops, base=base, owner=owner, events=events)
        except (RuntimeError, OSError) as exc:  # out of device memory, or no memory for the emulation
            raise TierFull(f"no hbm pool for {self.words.named(owner)}: {exc}") from None
