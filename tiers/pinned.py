"""Every host arena page-locked while an hbm pool copies in and out of it.

More: tiers/README.md (### pinned.py).
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

