"""One tier made of one part per owner (a tenant): the host arenas (arenas.py) and the hbm
pools (pools.py) are both trust domains, one per tenant, behind a single tier the placement
core sees.

A slot number says which part it is in (part ``i`` numbers its slots from ``i << PART_BITS``),
a key is in at most one part (its namespace's owner's), and what must happen in one owner's
part (reserving a slot) is asked of that part, ``part(owner)``. Each part tells its own
events (the core's eviction order of that part, named by the part's ``owner``). A part is
made at its owner's first use (``_make``) and lives as long as the server: clients and engines
hold mappings of it.

Thread-safety: every part guards itself; the list of parts only grows (under ``_lock``), and a
reader that iterates it without the lock sees a prefix of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from kvstore.page import PageHeader
from kvstore.tiers.base import UNOWNED, Quarantined, ReadResult, StoredPage, TierUsage, parent_links

logger = logging.getLogger(__name__)

PART_BITS = 40  # a part holds at most 1 TiB; slot >> PART_BITS is its part

P = TypeVar("P", bound=Any)  # a HostTier or an HbmTier


class OwnerParts(Generic[P]):
    """The slots and keys of a tier of per-owner parts, each asked of the part that holds it."""

    what = "part"  # named in logs and errors

    def __init__(self) -> None:
        self._parts: list[P] = []
        self._by_owner: dict[str, P] = {}
        self._lock = threading.Lock()

    def _owner(self, owner: str) -> str:
        """The owner whose part serves ``owner`` (the one part without tenants: UNOWNED)."""
        return owner

    def _make(self, owner: str, base: int) -> P:
        """A new part whose slots are numbered from ``base``; TierFull when it cannot be made."""
        raise NotImplementedError

    # -- the parts -----------------------------------------------------------------------

    def part(self, owner: str) -> P:
        """``owner``'s part, made now at its first use (TierFull when it cannot be made)."""
        owner = self._owner(owner)
        found = self._by_owner.get(owner)
        if found is not None:
            return found
        with self._lock:
            found = self._by_owner.get(owner)
            if found is None:
                found = self._make(owner, len(self._parts) << PART_BITS)
                self._parts.append(found)
                self._by_owner[owner] = found
                logger.info("%s %d made for tenant %r", self.what, len(self._parts) - 1, owner)
            return found

    def parts(self) -> list[P]:
        return list(self._parts)

    def _at(self, slot: int) -> P:
        return self._parts[slot >> PART_BITS]

    def holder(self, key: bytes) -> P | None:
        """The part that holds ``key`` (None: none does)."""
        return next((part for part in list(self._parts) if part.contains(key)), None)

    # -- slots: in the part their number names -------------------------------------------

    def reserve(self, payload_bytes: int) -> int | None:
        return self.part(UNOWNED).reserve(payload_bytes)

    def unreserve(self, slot: int) -> None:
        self._at(slot).unreserve(slot)

    def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        for page in pages:
            self._at(page[0]).write([page])

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        links = parent_links(parents, len(pages))
        for part in self.parts():
            mine = [(page, parent) for page, parent in zip(pages, links, strict=True) if self._at(page[0]) is part]
            if mine:
                part.commit([page for page, _ in mine], [parent for _, parent in mine])

    def offset(self, slot: int) -> int:
        return self._at(slot).offset(slot)

    # -- keys: in the part that holds them -----------------------------------------------

    def read_into(self, pages: list[tuple[bytes, memoryview]], verify: bool = True) -> ReadResult:
        for index, page in enumerate(pages):
            part = self.holder(page[0])
            if part is None:
                return ReadResult(index)
            result = part.read_into([page], verify)
            if result.num_read == 0:
                return ReadResult(index, result.reason)
        return ReadResult(len(pages))

    def contains(self, key: bytes) -> bool:
        return self.holder(key) is not None

    def find(self, key: bytes) -> tuple[int, PageHeader] | None:
        part = self.holder(key)
        return part.find(key) if part is not None else None

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        return sum(part.delete(keys, evicted) for part in self.parts())

    def quarantine(self, key: bytes, reason: str) -> None:
        part = self.holder(key)
        if part is not None:
            part.quarantine(key, reason)

    def quarantined(self, purge: bool = False) -> list[Quarantined]:
        return [q for part in self.parts() for q in part.quarantined(purge)]

    def stored_keys(self) -> list[bytes]:
        return [key for part in self.parts() for key in part.stored_keys()]

    # -- index ---------------------------------------------------------------------------

    def recover(self) -> list[StoredPage]:
        return []  # RAM or device memory: what the last process held is gone

    def usage(self) -> TierUsage:
        usages = [part.usage() for part in self.parts()]
        return TierUsage(sum(u.num_pages for u in usages), sum(u.used_bytes for u in usages),
                         sum(u.capacity_bytes for u in usages))

    def close(self) -> None:
        for part in self.parts():
            part.close()
