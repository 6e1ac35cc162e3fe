"""Completion markers of prefill -> decode handoffs, held at the decode node (DESIGN §12.7).

More: kvstore/server/README.md (### handoff_markers.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.errors import LeaseExpired, LimitExceeded
from kvstore.server.layer_landings import LayerLanding
from kvstore.server.placement import Placement
from kvstore.server.tenancy.owners import owner_for

logger = logging.getLogger(__name__)

MAX_HANDOFFS_PER_TENANT = 256  # markers (decode side) or open handoffs (prefill side) a tenant holds at once
MAX_TTL_S = 600.0
LEASE_MARGIN_MS = 5_000  # a pin's lease outlives its marker's ttl by this: the sweeper releases it first
MAX_TAKEN_OVER = 65_536  # handoffs remembered as taken over, each to its ttl's end (the oldest forgotten first)
QUOTA_PATIENCE_S = 1.0  # a pool handoff's pulls that find the caller's quota full, landing nothing, this long: answered
POOL_FIRST_STEP_S = 0.005  # a pool handoff's second pull (then 10, 20 ... 400 ms): its last pages land ~3 ms after the prefill answers

MarkerKey = tuple[str, bytes, bytes]  # tenant, namespace id, handoff id


@dataclass
class Marker:
    tenant: str
    namespace_id: bytes
    handoff_id: bytes
    generation: int  # the namespace's when the marker was made; another one later: the marker is void
    expires: float  # monotonic
    ttl_ms: int
    keys: list[bytes] | None = None  # every page of the handoff, once the prefill node completed it
    pushed: bool = False  # a prefill node pushed pages to it (direct); else the decode side pulls them (pool)
    leases: list[bytes] = field(default_factory=list)
    pinned: set[bytes] = field(default_factory=set)
    handed: set[bytes] = field(default_factory=set)  # returned by a wait, not yet acquired by the caller
    waiters: int = 0
    layers: LayerLanding | None = None  # slots its pages' layers landed in before they were stored at the holder

    @property
    def key(self) -> MarkerKey:
        return self.tenant, self.namespace_id, self.handoff_id


class HandoffMarkers:
    def __init__(self, core: Placement, per_tenant: int = MAX_HANDOFFS_PER_TENANT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.node = core.node
        self.per_tenant = per_tenant
        self.clock = clock
        self._markers: dict[MarkerKey, Marker] = {}
        self._per_tenant: dict[str, int] = {}
        # handoffs whose reader took over every page its wait was handed -> the end of their ttl: a
        # Complete or Push after that (a decode's wait may come first) makes no marker, pins nothing
        self._taken: OrderedDict[MarkerKey, float] = OrderedDict()
        self._changed = threading.Condition()  # the table's lock; notified whenever pages arrive or a marker goes
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="handoff-ttl", daemon=True)

    def start(self) -> None:
        self._sweeper.start()

    def close(self) -> None:
        self._stop.set()
        if self._sweeper.is_alive():
            self._sweeper.join(5)
        with self._changed:
            markers = list(self._markers.values())
        for marker in markers:
            self._drop(marker)
        with self._changed:
            self._taken.clear()

    def __len__(self) -> int:
        return len(self._markers)

    def held(self, namespace_id: bytes, keys: list[bytes]) -> int:
        """How many leading ``keys`` this node holds a copy of (not only a record of another node's)."""
        directory = self.core.directory
        for i, key in enumerate(keys):
            entry = directory.get(key)
            if entry is None or entry.namespace_id != namespace_id or not any(n == self.node for n, _ in list(entry.locations)):
                return i
        return len(keys)

    # -- the table ----------------------------------------------------------------------
    def open(self, tenant: str, namespace_id: bytes, handoff_id: bytes, ttl_ms: int, waiter: bool = False) -> Marker:
        """The marker of the handoff, made if there is none (LimitExceeded past ``per_tenant``:
        nothing made); a later open may only lengthen its ttl. ``waiter``: the caller's ``wait``
        (``registered=True``) follows, and it counts as the marker's reader from here on, so that
        nothing (a wait that left, the ttl) drops the marker between the two. But for a wait, the
        opener of a handoff its reader took over already (``acquired``) gets a marker outside the
        table: nothing that arrives for it is pinned."""
        key = (tenant, namespace_id, handoff_id)
        now = self.clock()
        generation = self.core.directory.generation(namespace_id)
        stale = self._markers.get(key)
        if stale is not None and stale.generation != generation:
            self._drop(stale)  # of an older generation: its pins go, nothing of it is handed
        with self._changed:
            marker = self._markers.get(key)
            if marker is None and not waiter and self._taken.get(key, now) > now:
                return Marker(tenant, namespace_id, handoff_id, generation, now, ttl_ms)
            if marker is None:
                if self._per_tenant.get(tenant, 0) >= self.per_tenant:
                    raise LimitExceeded(f"tenant {tenant!r} holds {self.per_tenant} handoffs already; "
                                        "complete or consume some, or let them expire")
                marker = Marker(tenant, namespace_id, handoff_id, generation, now + ttl_ms / 1000, ttl_ms)
                self._markers[key] = marker
                self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
            marker.waiters += waiter
            longer = now + ttl_ms / 1000 > marker.expires
            marker.expires = max(marker.expires, now + ttl_ms / 1000)
            marker.ttl_ms = max(marker.ttl_ms, ttl_ms)
            leases = list(marker.leases) if longer else []
        for lease in leases:  # the pins last as long as the marker
            try:
                self.core.renew(lease, self._lease_ms(ttl_ms))
            except LeaseExpired:
                pass  # released meanwhile (the marker was dropped)
        return marker

    def _lease_ms(self, ttl_ms: int) -> int:
        """A pin's lease: the marker's ttl and a margin, so that the sweeper lets it go before it expires on its own."""
        return min(ttl_ms + LEASE_MARGIN_MS, self.core.leases.max_lease_ms)

    def _forget(self, marker: Marker) -> bool:
        """Takes the marker out of the table (under the lock); False when it was out already."""
        if self._markers.get(marker.key) is not marker:
            return False
        del self._markers[marker.key]
        left = self._per_tenant[marker.tenant] - 1
        if left:
            self._per_tenant[marker.tenant] = left
        else:
            del self._per_tenant[marker.tenant]
        self._changed.notify_all()
        return True

    def _drop(self, marker: Marker, only_if: Callable[[], bool] | None = None) -> bool:
        """Out of the table, its pins released: nothing of it is left. ``only_if``: decided
        again under the lock, where it is dropped (a wait may have come in since); False: kept."""
        with self._changed:
            if only_if is not None and not only_if():
                return False
            forgot = self._forget(marker)
            leases, marker.leases = marker.leases, []
            marker.pinned.clear()
            marker.handed.clear()
            layers, marker.layers = marker.layers, LayerLanding(self.core, closed=True)
        for lease in leases:
            self.core.release(lease)
        if layers is not None:
            layers.close()
        return forgot

    def layers(self, marker: Marker) -> LayerLanding:
        """The marker's layer landing (made now; a closed one once the marker was dropped)."""
        with self._changed:
            if marker.layers is None:
                marker.layers = LayerLanding(self.core, closed=self._markers.get(marker.key) is not marker)
            return marker.layers

    # -- pages arriving -----------------------------------------------------------------
    def arrived(self, marker: Marker, keys: list[bytes], pushed: bool = False, complete: list[bytes] | None = None) -> None:
        """Pins the leading ``keys`` held here that the marker does not pin yet; ``complete``:
        every page of the handoff (the prefill node finished). Wakes the waiters."""
        with self._changed:
            live = self._markers.get(marker.key) is marker
            new = [k for k in keys[: self.held(marker.namespace_id, keys)] if k not in marker.pinned]
        if live and new:
            lease, found, _ = self.core.lease(marker.namespace_id, new, self._lease_ms(marker.ttl_ms), owner_for(marker.tenant))
            with self._changed:
                if self._markers.get(marker.key) is marker:
                    marker.leases.append(lease)
                    marker.pinned.update(new[:found])
                    lease = b""
            if lease:  # dropped meanwhile: its pins go with it
                self.core.release(lease)
        with self._changed:
            marker.pushed = marker.pushed or pushed
            if complete is not None:
                marker.keys = complete
            self._changed.notify_all()

    # -- the decode side ----------------------------------------------------------------
    def wait(self, marker: Marker, keys: list[bytes], deadline_s: float, pull: Callable[[float], bool] | None,
             sees: Callable[[], bool] = lambda: True, alive: Callable[[], bool] = lambda: True,
             registered: bool = False) -> int:
        """Waits until every page of ``keys`` is held here, the marker is complete, or ``deadline_s``
        passed; returns the leading pages of ``keys`` held here for the caller (0 when the marker
        went: expired, or its namespace invalidated). ``pull(time_left_s)``: fetches ``keys``
        through the pool; called while no prefill node pushes to the marker, at once, then after
        5, 10, 20 ... 400 ms (the step doubles): a pool handoff's last pages are published a few ms
        after the prefill answers, about when the decode side asks, so the second pull must not be
        far behind the first. A pull returns True when the caller's quota here held fewer of
        ``keys`` than it lacked: pulls that land nothing for ``QUOTA_PATIENCE_S`` so (the quota
        full of pages pinned longer than a read's while, most often the handoff's own) end the
        wait with what is held.
        ``sees()``: the caller may read the namespace here; if not, pages held here are not its
        own and the wait answers as for an unknown id (nothing, at the deadline). ``alive()``
        false: the caller left (its call was cancelled; ``wake`` then cuts the sleep short):
        nothing is handed, and a marker no other wait reads goes with its pins at once.
        ``registered``: ``open(waiter=True)`` counted this wait already."""
        end = time.monotonic() + deadline_s  # the caller's deadline is real time (``clock`` runs the ttls)
        step = POOL_FIRST_STEP_S
        full_since: float | None = None  # since when the pulls found the caller's quota full, landing nothing
        if not registered:
            with self._changed:
                marker.waiters += 1
        try:
            while True:
                if self._finished(marker, keys, sees):
                    break
                left = end - time.monotonic()
                if not alive():
                    return self._left(marker)
                if left <= 0:
                    break
                if pull is not None and not marker.pushed:
                    had = self.held(marker.namespace_id, keys)
                    full = pull(left)
                    if sees():
                        self.arrived(marker, keys)
                    if self._finished(marker, keys, sees):
                        break
                    now = time.monotonic()
                    full_since = (full_since or now) if full and self.held(marker.namespace_id, keys) == had else None
                    if full_since is not None and now - full_since >= QUOTA_PATIENCE_S:
                        break  # the caller's quota here held no more of them for a while: what is held is answered
                left = max(0.0, end - time.monotonic())
                with self._changed:  # woken by arrivals (a push, a complete); the pool's pulls only on the step
                    if not self._finished(marker, keys, sees):  # under the lock: an arrival's notify is not missed
                        self._changed.wait(left if marker.pushed or pull is None else min(step, left))
                step = min(2 * step, 0.4)
            return self._hand(marker, keys if sees() else [], alive)
        finally:
            with self._changed:
                marker.waiters -= 1

    def _left(self, marker: Marker) -> int:
        """The caller left mid-wait: nothing is handed, and a marker no other wait reads is
        dropped with its pins (a page pushed later makes it again, for its ttl at most)."""
        self._drop(marker, only_if=lambda: marker.waiters == 1 and not marker.handed)
        return 0

    def wake(self) -> None:
        """Wakes every wait to check its caller again (a cancelled call)."""
        with self._changed:
            self._changed.notify_all()

    def _finished(self, marker: Marker, keys: list[bytes], sees: Callable[[], bool]) -> bool:
        if self._markers.get(marker.key) is not marker:
            return True  # expired or invalidated: answered with nothing
        if not sees():
            return False
        if marker.keys is not None and all(k in marker.pinned for k in marker.keys):
            return True
        return self.held(marker.namespace_id, keys) == len(keys)

    def _hand(self, marker: Marker, keys: list[bytes], alive: Callable[[], bool] = lambda: True) -> int:
        """What the wait answers: the leading ``keys`` held here and pinned for the caller, who
        takes them over by acquiring them. Nothing (and the marker dropped) when the namespace
        moved to another generation or nothing is held; nothing either when the caller left
        meanwhile (as its pages came, or during a pull): ``_left``."""
        if not alive():
            return self._left(marker)
        self.arrived(marker, keys)  # a page the pool brought, or held here before the marker
        live = self._markers.get(marker.key) is marker
        generation = self.core.directory.generation(marker.namespace_id)
        n = self.held(marker.namespace_id, keys) if live and generation == marker.generation else 0
        with self._changed:
            n = next((i for i, k in enumerate(keys[:n]) if k not in marker.pinned), n)
            marker.handed.update(keys[:n])
        if n == 0:
            self._drop(marker)
        return n

    def acquired(self, tenant: str, namespace_id: bytes, keys: list[bytes]) -> None:
        """The caller acquired ``keys``: a marker whose handed pages it has all acquired lets them go
        (kept where a wait came in meanwhile: that wait reads it, or was handed its pins)."""
        if not self._markers:
            return
        done: list[Marker] = []
        with self._changed:
            for marker in self._markers.values():
                if marker.tenant == tenant and marker.namespace_id == namespace_id and marker.handed and not marker.waiters:
                    marker.handed.difference_update(keys)
                    if not marker.handed:
                        done.append(marker)
        with self._changed:  # before the drop: a Complete in between finds the marker, or this
            for marker in done:
                self._taken[marker.key] = marker.expires
                self._taken.move_to_end(marker.key)
            while len(self._taken) > MAX_TAKEN_OVER:
                self._taken.popitem(last=False)
        for marker in done:  # unless a wait came in since: it reads the marker, or was handed its pins
            self._drop(marker, only_if=lambda marker=marker: not marker.waiters and not marker.handed)

    def abandon(self, tenant: str, namespace_id: bytes, handoff_id: bytes, ttl_ms: int) -> None:
        """The prefill node handed off nothing, or the decode takes nothing more of it: the marker
        goes with its pins (a wait on it answers nothing now), and for ``ttl_ms`` (the marker's own
        ttl where it is longer) a push still on its way pins nothing (as once taken over), whether
        it is served before the abandon (its marker is gone when its pages arrive) or after
        (remembered here even with no marker yet: a push the prefill node cancelled may still come)."""
        key = (tenant, namespace_id, handoff_id)
        with self._changed:
            marker = self._markers.get(key)
            until = max(self.clock() + ttl_ms / 1000, marker.expires if marker is not None else 0.0)
            self._taken[key] = max(self._taken.get(key, 0.0), until)
            self._taken.move_to_end(key)
            while len(self._taken) > MAX_TAKEN_OVER:
                self._taken.popitem(last=False)
        if marker is not None:
            pages = len(marker.pinned)
            self._drop(marker)
            logger.info("handoff %s of tenant %r abandoned (a Complete with no page), %d pages let go", handoff_id.hex()[:8],
                        tenant, pages)

    # -- expiry -------------------------------------------------------------------------
    def expire(self) -> int:
        """Drops the markers past their ttl or of a namespace that moved to another generation; returns how many."""
        now = self.clock()

        def due(m: Marker) -> bool:
            return not m.waiters and (m.expires <= now or self.core.directory.generation(m.namespace_id) != m.generation)

        with self._changed:
            gone = [m for m in self._markers.values() if due(m)]
            while self._taken and next(iter(self._taken.values())) <= now:  # the oldest first: a sweep scans
                self._taken.popitem(last=False)  # no more than it drops (open() checks each entry's end itself)
        dropped = 0
        for marker in gone:
            pages = len(marker.pinned)
            if self._drop(marker, only_if=lambda marker=marker: due(marker)):  # a wait or an open since keeps it
                dropped += 1
                logger.info("handoff %s of tenant %r dropped (%s), %d pages let go", marker.handoff_id.hex()[:8],
                            marker.tenant, "ttl" if marker.expires <= now else "invalidated", pages)
        return dropped

    def _sweep(self) -> None:
        while not self._stop.wait(self._next_due()):
            try:
                self.expire()
            except Exception:  # the sweeper outlives one bad round
                logger.exception("handoff expiry failed")

    def _next_due(self) -> float:
        with self._changed:
            first = min((m.expires for m in self._markers.values()), default=None)
        due = 1.0 if first is None else first - self.clock()
        return min(1.0, max(0.01, due))
