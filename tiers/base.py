"""What every tier offers the tier manager.

Contract shared by all tiers:
* Batch-free and synchronous; the tier manager serialises metadata changes under its own
  lock, so a tier need not be thread-safe for those. Reads of stored bytes may run
  concurrently with other reads.
* A miss is a value (``None`` / ``False``), never an exception.
* ``get`` verifies length and checksum before returning; a page that fails raises
  ``PageCorrupt`` and has been removed from the tier.
* ``put`` of a key that is already stored replaces nothing and returns True.
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

    def put(self, header: PageHeader, payload: memoryview) -> bool: ...

    def get(self, key: bytes, into: memoryview) -> PageHeader | None: ...

    def delete(self, key: bytes) -> bool: ...

    def keys(self) -> list[bytes]: ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None: ...
