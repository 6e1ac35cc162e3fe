"""The hinted keys each tenant holds against its ``hints`` quota.

A Hint charges each of its keys until its eta plus the hint grace, or until the key is used
(acquired or read) before then, whichever comes first: an announced use that happened
costs the tenant nothing more. A Hint is charged whole or not at all, and a Hint the
server then refuses gives its charge back (``refund``).

More: kvstore/server/tenancy/README.md (### hint_charges.py).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable

from kvstore.errors import QuotaExceeded


class HintCharges:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._due: list[tuple[float, int]] = []  # (until, charge id), one per charged key
        self._live: dict[int, tuple[str, bytes, float]] = {}  # charge id -> (tenant, key, until), until it ends
        self._by_key: dict[tuple[str, bytes], list[int]] = {}  # (tenant, key) -> its live charges, soonest first
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        with self._lock:
            self._expire()
            return self._held.get(tenant, 0)

    def charge(self, tenant: str, entries: list[tuple[list[bytes], float]], limit: int) -> list[int]:
        """Charges every key of ``entries`` ((keys, until) pairs), or none: raises
        QuotaExceeded when together they would pass ``limit`` (0: none). Returns the charges,
        for ``refund``."""
        num_keys = sum(len(keys) for keys, _ in entries)
        with self._lock:
            self._expire()
            held = self._held.get(tenant, 0)
            if limit and held + num_keys > limit:
                raise QuotaExceeded(tenant, "hints", held, num_keys, limit)
            self._held[tenant] = held + num_keys
            ids = []
            for keys, until in sorted(entries, key=lambda entry: entry[1]):
                for key in keys:
                    ident = next(self._ids)
                    self._live[ident] = (tenant, key, until)
                    self._by_key.setdefault((tenant, key), []).append(ident)
                    heapq.heappush(self._due, (until, ident))
                    ids.append(ident)
            return ids

    def refund(self, ids: list[int]) -> None:
        """Ends charges of a Hint that did not happen."""
        with self._lock:
            for ident in ids:
                self._end(ident)

    def used(self, tenant: str, keys: list[bytes]) -> None:
        """``tenant`` used ``keys``: the soonest charge of each ends now. A tenant holding no
        charge (every Acquire of a tenant that never hints) takes no lock and looks up no key:
        a Hint racing this use is one of two concurrent calls, in either order."""
        if not self._held.get(tenant):
            return
        with self._lock:
            for key in keys:
                ids = self._by_key.get((tenant, key))
                if ids:
                    self._end(ids[0])

    def _end(self, ident: int) -> None:
        """Lock held. Its entry in ``_due`` stays, and is skipped when it comes due."""
        found = self._live.pop(ident, None)
        if found is None:
            return
        tenant, key, _ = found
        ids = self._by_key[(tenant, key)]
        ids.remove(ident)
        if not ids:
            del self._by_key[(tenant, key)]
        self._held[tenant] -= 1
        if len(self._due) > 2 * len(self._live) + 1024:
            self._due = [(until, i) for i, (_, _, until) in self._live.items()]
            heapq.heapify(self._due)

    def _expire(self) -> None:
        now = self._clock()
        while self._due and self._due[0][0] <= now:
            self._end(heapq.heappop(self._due)[1])
