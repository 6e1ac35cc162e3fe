"""Every host arena page-locked while an hbm pool copies in and out of it.

Promotions into a pool and demotions out of it copy between an arena and device memory;
from page-locked memory that is DMA at link speed, from pageable memory a staged copy
through a driver bounce buffer. So with hbm every arena is pinned: the one arena without
tenants, and each tenant's arena as it is made (arenas.py makes them at a tenant's first
use, long after start). Page-locking is per process: this pins the server's own mappings;
an engine pins its mapping itself (client/arena.py).

The page-locking itself is the device seam's (``DeviceOps.pin_host``): ``cudaHostRegister``
on CUDA, a recorded range in the CPU implementation the tests run.
"""

from __future__ import annotations

import threading

from kvstore.device_ops import DeviceOps, host_address
from kvstore.tiers.base import LandingTier, TierWrapper
from kvstore.tiers.host import HostTier


class ArenaPins:
    """Pins arenas through ``ops`` and unpins them before they are unmapped. Thread-safe."""

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops
        self._pinned: dict[int, int] = {}  # id(arena) -> the address pinned (absent: refused, or not pinned)
        self._lock = threading.Lock()

    def pin(self, arena: HostTier) -> None:
        """Page-locks ``arena``'s whole mapping (a refusal is logged by the seam: copies still work, slower)."""
        memory = arena.memory()
        address = host_address(memory)
        if self.ops.pin_host(address, len(memory)):
            with self._lock:
                self._pinned[id(arena)] = address

    def unpin(self, arena: HostTier) -> None:
        with self._lock:
            address = self._pinned.pop(id(arena), None)
        if address is not None:
            self.ops.unpin_host(address)


class PinnedArena(TierWrapper):
    """The one arena of a server without tenant arenas, pinned while it is open."""

    def __init__(self, inner: HostTier, pins: ArenaPins) -> None:
        super().__init__(inner)
        self.pins = pins
        pins.pin(inner)

    def close(self) -> None:
        self.pins.unpin(self.inner)  # type: ignore[arg-type]
        self.inner.close()


def pinned(host: HostTier, pins: ArenaPins | None) -> LandingTier:
    """``host`` itself unless an hbm pool copies through it (``pins``)."""
    return host if pins is None else PinnedArena(host, pins)  # type: ignore[return-value]  # a LandingTier by delegation
