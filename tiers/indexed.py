"""The in-memory page index the RAM-like tiers (host, hbm) share: key -> (slot, header).
One definition of the lookups the Tier protocol asks of it, so the two tiers cannot drift."""

from __future__ import annotations

from kvstore.page import PageHeader


class IndexedPages:
    """Mixed into a tier that keeps ``self._pages``; the tier guards writes to it."""

    _pages: dict[bytes, tuple[int, PageHeader]]

    def contains(self, key: bytes) -> bool:
        return key in self._pages

    def header(self, key: bytes) -> PageHeader | None:
        entry = self._pages.get(key)
        return entry[1] if entry else None

    def slot_of(self, key: bytes) -> int | None:
        entry = self._pages.get(key)
        return entry[0] if entry else None
