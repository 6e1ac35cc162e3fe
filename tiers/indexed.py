"""The in-memory page index the RAM-like tiers (host, hbm) share: key -> (slot, header),
and their quarantine list. One definition of what the Tier protocol asks of them, so the
two tiers cannot drift."""

from __future__ import annotations

import logging
import threading
import time

from kvstore.page import PageHeader
from kvstore.tiers.base import Quarantined

logger = logging.getLogger(__name__)


class IndexedPages:
    """Mixed into a tier that keeps ``self._pages``, ``self._quarantine`` and ``self._lock``
    and names itself in ``self.name``; the tier guards writes to ``_pages``."""

    name: str
    _pages: dict[bytes, tuple[int, PageHeader]]
    _quarantine: list[Quarantined]
    _lock: threading.Lock

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:  # pragma: no cover - each tier has its own
        raise NotImplementedError

    def contains(self, key: bytes) -> bool:
        return key in self._pages

    def find(self, key: bytes) -> tuple[int, PageHeader] | None:
        return self._pages.get(key)

    def detach(self, key: bytes) -> int | None:  # pragma: no cover - each tier has its own
        raise NotImplementedError

    def quarantine(self, key: bytes, reason: str) -> None:
        found = self.find(key)
        if found is not None and self.delete([key]):  # else another report of the same damage dropped it first
            self._list(key, found[1], reason)

    def quarantine_detached(self, key: bytes, reason: str) -> int | None:
        """``quarantine``, its slot kept reserved and returned (``detach``): readers that lease
        the page still read it there; the caller unreserves it once they let go."""
        found = self.find(key)
        if found is None:
            return None
        slot = self.detach(key)
        if slot is not None:  # else another report of the same damage dropped it first
            self._list(key, found[1], reason)
        return slot

    def _list(self, key: bytes, header: PageHeader, reason: str) -> None:
        logger.error("%s tier: quarantining page %s: %s", self.name, key.hex(), reason)
        with self._lock:
            self._quarantine.append(Quarantined(key, header.namespace_id, reason, time.time()))

    def quarantined(self, purge: bool = False) -> list[Quarantined]:
        with self._lock:
            listed = list(self._quarantine)
            if purge:
                self._quarantine.clear()
            return listed
