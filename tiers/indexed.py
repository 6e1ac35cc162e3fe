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

    def header(self, key: bytes) -> PageHeader | None:
        entry = self._pages.get(key)
        return entry[1] if entry else None

    def slot_of(self, key: bytes) -> int | None:
        entry = self._pages.get(key)
        return entry[0] if entry else None

    def quarantine(self, key: bytes, reason: str) -> None:
        header = self.header(key)
        if header is None:
            return
        if not self.delete([key]):
            return  # another report of the same damage dropped it first: listed once
        logger.error("%s tier: quarantining page %s: %s", self.name, key.hex(), reason)
        with self._lock:
            self._quarantine.append(Quarantined(key, header.namespace_id, reason, time.time()))

    def quarantined(self) -> list[Quarantined]:
        with self._lock:
            return list(self._quarantine)

    def purge_quarantine(self) -> int:
        with self._lock:
            count = len(self._quarantine)
            self._quarantine.clear()
            return count
