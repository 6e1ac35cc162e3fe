"""What every tier offers the tier manager.

Contract shared by all tiers:
* Synchronous; the tier manager serialises metadata changes under its own lock, so a tier
  need not be thread-safe for those. Reads of stored bytes may run concurrently with other
  reads.
* A miss is a value (``None`` / ``False``), never an exception.

Writing and reading bytes is tier-specific (host: arena slots the manager hands out; ssd:
reserve -> write_slot -> sync -> index, and a verifying ``read``), because the manager
overlaps each differently with its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvstore.page import PageHeader


@dataclass(frozen=True)
class TierUsage:
    num_pages: int
    used_bytes: int
    capacity_bytes: int


class Tier(Protocol):
    name: str

    def contains(self, key: bytes) -> bool: ...

    def header(self, key: bytes) -> PageHeader | None: ...

    def delete(self, key: bytes) -> bool: ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None: ...
