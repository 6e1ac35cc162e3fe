"""Pages a reader reports failing their checksum in the arena: checked here, quarantined if
they do fail.

More: kvstore/server/placement/README.md (### reported.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.errors import PageCorrupt
from kvstore.pagecopy import checksum_released

if TYPE_CHECKING:
    from kvstore.server.placement.core import Placement

MAX_REPORTED = 1  # keys of a Release checked: a reader stops at the first page that fails
CHECKS_PER_S = 4.0  # per owner: what a reader that finds damaged pages needs, and a bound on what a caller can make us hash
REASON = "its bytes in the arena do not match its checksum (reported by a reader)"


class ReportBudget:
    """How many reported pages each owner (the caller's, as its gate resolved it) may still have
    checked: a bucket of CHECKS_PER_S per second, CHECKS_PER_S deep. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # owner -> (tokens, when)

    def take(self, owner: str) -> bool:
        now = self._clock()
        with self._lock:
            tokens, when = self._buckets.get(owner, (CHECKS_PER_S, now))
            tokens = min(CHECKS_PER_S, tokens + (now - when) * CHECKS_PER_S)
            if tokens < 1:
                self._buckets[owner] = (tokens, now)
                return False
            self._buckets[owner] = (tokens - 1, now)
            return True


def check_reported(core: Placement, lease_id: bytes, owner: str | None, keys: list[bytes],
                   budget: Callable[[], bool] = lambda: True) -> int:
    """Verifies the landing copies of ``keys`` held by the lease ``lease_id`` (of ``owner``,
    when given); quarantines those that fail. Returns how many did. Call before the release.
    ``budget`` is asked only when there is a copy to hash: a reader holding several leases
    names its failed page at each release, and those that do not hold it must not spend the
    check the one that does needs (a ReportBudget's ``take``)."""
    with core.keeper.critical():
        leased = core.leases.keys_of(lease_id, owner)
        wanted = set(keys) & set(leased or ())
        found = [arena.find(key) if (arena := core.landing.part_of(key)) is not None else None for key in wanted]
    pages = [page for page in found if page is not None]
    if not pages or not budget():
        return 0
    failed = 0
    for slot, header in pages:
        try:  # the lease pins the page against eviction; quarantine_landing checks it is still this copy
            header.verify_payload(core.landing.at(slot).view(slot, header.payload_bytes), header.payload_bytes, checksum_released)
        except PageCorrupt:
            core.reads.quarantine_landing(header, REASON, slot)
            failed += 1
    return failed
