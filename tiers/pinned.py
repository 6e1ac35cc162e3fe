"""Every host arena page-locked while an hbm pool copies in and out of it.

Promotions into a pool and demotions out of it copy between an arena and device memory;
from page-locked memory that is DMA at link speed, from pageable memory a staged copy
through a driver bounce buffer. So with hbm every arena is pinned as arenas.py makes it: the
one arena without tenants at start, each tenant's at its first use, long after start (and
unpinned at close). Page-locking is per process: this pins the server's own mappings; an
engine pins its mapping itself (client/arena.py).

The page-locking itself is the device seam's (``DeviceOps.pin_host``): ``cudaHostRegister``
on CUDA, a recorded range in the CPU implementation the tests run.
"""

from __future__ import annotations

import threading

from kvstore.device_ops import DeviceOps, host_address
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

