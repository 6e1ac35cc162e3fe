"""Places pages in tiers, moves them on pressure and use, and keeps the directory true.

Page life in the host tier::

    allocate --> reserved --commit--> stored --evict--> (demoted to ssd | dropped)
        |                  \\--abort/expire--> freed       ^
        '-- stored already: nothing to write               '-- promoted from ssd on acquire

A page is published in the directory only once its bytes are in the tier named by the
location (host: committed to the arena; ssd: synced and indexed). Pinned pages (leases,
acquisitions) are never evicted or freed; a page removed while pinned is doomed and freed
when its last pin goes.

Thread-safety: every public method takes ``self._lock``; the host arena's bytes are written
by clients outside it, only into slots they were allocated.
"""

from __future__ import annotations

import gc
import heapq
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstore.server.admission import AdmissionPolicy, WriteBudget, make_policy
from kvstore.config import ServerConfig
from kvstore.directory import Directory
from kvstore.errors import InvalidRequest, LeaseExpired, MetadataFull, NamespaceMismatch, PageCorrupt, TierFull, TierUnavailable
from kvstore.server.eviction import HostResidency
from kvstore.server.metrics import Metrics
from kvstore.page import ENGINE_FLAGS, FLAG_WANTED, LayoutDesc, PageHeader
from kvstore.server.recovery import rebuild_directory
from kvstore.server.stats import ManagerStats, collect_stats, refresh_gauges
from kvstore.tiers.base import TierUsage
from kvstore.tiers.host import HostTier
from kvstore.tiers.ssd import Quarantined, SsdTier

logger = logging.getLogger(__name__)


@dataclass
class Allocation:
    namespace_id: bytes
    layout: LayoutDesc
    slots: dict[bytes, int]       # key -> reserved host offset
    expires: float
    keys: list[bytes]             # the prefix allocate answered: stored already or reserved
    held: list[bytes]             # the keys stored already, pinned until commit/abort/expiry


@dataclass
class Lease:
    keys: list[bytes]
    expires: float


@dataclass(frozen=True)
class AcquiredPage:
    key: bytes
    offset: int
    checksum: int


def _damage(header: PageHeader, payload: memoryview) -> str | None:
    """Why ``payload`` is not the page ``header`` describes, or None when it is."""
    try:
        header.verify_payload(payload, len(payload))
    except PageCorrupt as exc:
        return str(exc)
    return None


class TierManager:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.node = config.node
        self.metrics = metrics or Metrics()
        self._lock = threading.RLock()
        # Recovery creates an object or two per stored page; the cyclic GC would rescan the
        # growing heap again and again meanwhile (none of these objects form cycles).
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            self.directory = Directory(config.data_dir, config.node, config.directory_map_bytes)
            self.host = HostTier(config.host, config.node)
            self.ssd = SsdTier(config.ssd) if "ssd" in config.tiers and config.ssd else None
            self._init_state(config, clock)
        finally:
            if gc_enabled:
                gc.enable()

    def _init_state(self, config: ServerConfig, clock: Callable[[], float]) -> None:
        self._last_ssd_error_log = 0.0
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-verify")  # checks beside disk writes
        self._residency = HostResidency(segmented=config.host.eviction == "slru")
        self.budget: WriteBudget | None = None
        self.admission: AdmissionPolicy | None = None
        if self.ssd is not None and config.ssd is not None:
            self.budget = WriteBudget.for_drive(config.ssd.capacity_bytes, config.ssd.dwpd, clock, config.ssd.burst_s,
                                                settle=self.ssd.index_writes.take)
            self.admission = make_policy(config.ssd.admission)
        self._ssd_lru: OrderedDict[bytes, None] = OrderedDict()
        self._pins: Counter[bytes] = Counter()
        self._doomed: set[tuple[bytes, str]] = set()  # (key, tier) to drop once unpinned
        self._layouts: dict[bytes, LayoutDesc] = {}
        self._allocations: dict[bytes, Allocation] = {}
        self._leases: dict[bytes, Lease] = {}
        self._expiry: list[tuple[float, bytes, str]] = []  # (deadline, id, "lease"|"alloc")
        self._host_quarantine: list[Quarantined] = []
        self._scrub_queue: list[bytes] = []
        self._scrub_buf = bytearray()
        self._recover()
        self._refresh_gauges()

    # -- start-up ------------------------------------------------------------------------

    def _recover(self) -> None:
        rebuild_directory(self)

    # -- housekeeping --------------------------------------------------------------------

    def _reap(self) -> None:
        self._residency.expire(self.clock(), self.config.host.hint_grace_s)
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            _, ident, kind = heapq.heappop(self._expiry)
            if kind == "lease":
                lease = self._leases.get(ident)
                if lease is not None and lease.expires > now:  # renewed: one entry per lease, moved on
                    heapq.heappush(self._expiry, (lease.expires, ident, "lease"))
                elif lease is not None:
                    del self._leases[ident]
                    logger.warning("lease %s expired with %d pages pinned", ident.hex()[:8], len(lease.keys))
                    self._unpin(lease.keys)
            else:
                alloc = self._allocations.pop(ident, None)
                if alloc is not None:
                    logger.warning("allocation %s expired uncommitted; freeing %d slots", ident.hex()[:8], len(alloc.slots))
                    for offset in alloc.slots.values():
                        self.host.unreserve(offset)
                    self._unpin(alloc.held)

    def _pin(self, keys: list[bytes]) -> None:
        self._pins.update(keys)

    def _unpin(self, keys: list[bytes]) -> None:
        self._pins.subtract(keys)
        for key in keys:
            if self._pins[key] <= 0:
                del self._pins[key]
                for tier in ("host", "ssd"):
                    if (key, tier) in self._doomed:
                        self._doomed.discard((key, tier))
                        self._drop_local(key, tier)

    def _check_layout(self, namespace_id: bytes, layout: LayoutDesc) -> None:
        """Raises unless ``layout`` may be used in the namespace; binds nothing (allocate
        binds it once a slot was taken, so a rejected request leaves no binding)."""
        known = self._layouts.get(namespace_id, layout)
        if known != layout:
            raise NamespaceMismatch(f"namespace {namespace_id.hex()} has layout {known}, request says {layout}")
        if layout.page_bytes <= 0:
            raise InvalidRequest(f"layout {layout} gives an empty page or an unknown dtype")
        if layout.page_bytes > self.config.max_page_bytes:
            raise InvalidRequest(f"page of {layout.page_bytes} bytes exceeds the limit of {self.config.max_page_bytes}")
        if not self.host.allocator.fits(layout.page_bytes):
            raise InvalidRequest(
                f"page of {layout.page_bytes} bytes does not fit a host slab of {self.host.allocator.slab_bytes} bytes; "
                "raise --host-capacity"
            )

    def _has(self, key: bytes, tier: str) -> bool:
        held = self.host.contains(key) if tier == "host" else bool(self.ssd and self.ssd.contains(key))
        return held and (key, tier) not in self._doomed

    def _stored(self, key: bytes) -> bool:
        return self._has(key, "host") or self._has(key, "ssd")

    # -- making room ---------------------------------------------------------------------

    def _host_reserve(self, page_bytes: int) -> int | None:
        """A host slot, evicting (demoting) least recently used unpinned pages as needed."""
        while True:
            offset = self.host.reserve(page_bytes)
            if offset is not None:
                return offset
            victim = self._residency.victim(self._pins, self._hint_share_pages(page_bytes))
            if victim is None:
                return None
            self._evict_host(victim)

    def _evict_host(self, key: bytes) -> None:
        slot = self.host.slot(key)
        assert slot is not None
        offset, header = slot
        if self.ssd is not None and not self.ssd.contains(key) and self._admit(header):
            try:
                self.host.verify(key)
            except PageCorrupt as exc:
                self._residency.remove(key)
                self._quarantine_host(header, str(exc))
                self.host.delete(key)
                return
            try:
                if self._ssd_write([(header, self.host.view(offset, header.payload_bytes))]) == 1:
                    self.metrics.demotions.labels("host").inc()
            except (OSError, MetadataFull):
                pass  # logged and counted by _ssd_write; the page leaves the cache as any eviction
        self._residency.remove(key, evicted=True)
        self.host.delete(key)
        self.directory.remove(key, self.node, "host")
        self.metrics.evictions.labels("host").inc()

    def _learn(self, key: bytes) -> None:
        """A use of ``key``: admission learns from it, and a hint for it is fulfilled."""
        if self.admission is not None:
            self.admission.record_access(key)
        self._residency.consume(key, self.clock())

    def _hint_share_pages(self, page_bytes: int) -> int:
        return int(self.config.host.hint_share * self.host.allocator.capacity // max(1, page_bytes))

    def _admit(self, header: PageHeader) -> bool:
        """Whether a page leaving the host tier is worth an SSD write (policy + budget)."""
        assert self.admission is not None and self.budget is not None
        cost = SsdTier.slot_bytes(header.payload_bytes)
        decision = self.admission.can_admit(header.key, header.flags, self.budget, cost)
        self.metrics.admissions.labels(self.admission.name, "admit" if decision.admit else "refuse", decision.reason).inc()
        if not decision.admit:
            self.admission.record_refused(header.key)
            self.metrics.ssd_refused_bytes.inc(cost)
        return decision.admit

    def _ssd_reserve(self, payload_bytes: int) -> int | None:
        assert self.ssd is not None
        while True:
            offset = self.ssd.reserve(payload_bytes)
            if offset is not None:
                return offset
            victim = next((k for k in self._ssd_lru if k not in self._pins), None)
            if victim is None:
                return None
            try:
                self.ssd.delete(victim)
            except MetadataFull:
                return None  # a full index cannot even record a delete: no room
            self._ssd_lru.pop(victim)
            self.directory.remove(victim, self.node, "ssd")
            self.metrics.evictions.labels("ssd").inc()

    def _ssd_write(self, items: list[tuple[PageHeader, memoryview]], before_sync: Callable[[], None] | None = None) -> int:
        """Writes pages durably to the ssd tier and publishes them; returns how many.

        Slots are reserved and the result indexed under the lock; the writes and the sync
        run outside it unless the caller already holds it (eviction). The payload views must
        stay valid meanwhile: the caller pins their keys or holds the lock. ``before_sync``
        runs after the writes; if it raises, the slots are freed and nothing is indexed.
        """
        assert self.ssd is not None
        ssd = self.ssd
        with self._lock:
            placed: list[tuple[int, PageHeader, memoryview]] = []
            for header, payload in items:
                if ssd.contains(header.key):
                    continue
                assert self.budget is not None
                if not self.budget.take(ssd.slot_bytes(header.payload_bytes)):  # index writes are settled after
                    self.metrics.ssd_refused_bytes.inc(ssd.slot_bytes(header.payload_bytes))
                    break  # over the endurance budget: the rest stays in RAM only
                offset = self._ssd_reserve(header.payload_bytes)
                if offset is None:
                    break
                placed.append((offset, header, payload))
        try:
            for offset, header, payload in placed:
                ssd.write_slot(offset, header, payload)
            if before_sync is not None:
                before_sync()
            if placed:
                ssd.sync()
        except PageCorrupt:
            with self._lock:
                for offset, _, _ in placed:
                    ssd.unreserve(offset)
            raise
        except OSError as exc:
            with self._lock:
                for offset, _, _ in placed:
                    ssd.unreserve(offset)
            self.metrics.ssd_errors.inc()
            self.metrics.ssd_errors_recent.set(1)
            now = time.monotonic()
            if now - self._last_ssd_error_log > 10:  # one line per 10 s, not one per page
                self._last_ssd_error_log = now
                logger.error("ssd tier: write failed (%s); serving from RAM, nothing stored is lost", exc)
            raise
        self.metrics.ssd_errors_recent.set(0)
        with self._lock:
            fresh = []
            for offset, header, _ in placed:
                if ssd.contains(header.key):  # a concurrent writer got there first
                    ssd.unreserve(offset)
                else:
                    fresh.append((offset, header))
            try:
                ssd.index(fresh)
            except MetadataFull as exc:
                for offset, _ in fresh:  # written but never indexed: free again, like a failed write
                    ssd.unreserve(offset)
                self.metrics.ssd_errors.inc()
                now = time.monotonic()
                if now - self._last_ssd_error_log > 10:
                    self._last_ssd_error_log = now
                    logger.error("ssd tier: %s; serving from RAM, nothing stored is lost", exc)
                raise
            by_ns: dict[bytes, list[tuple[bytes, str, str, int]]] = {}
            for _, header in fresh:
                self._ssd_lru[header.key] = None
                by_ns.setdefault(header.namespace_id, []).append((header.key, self.node, "ssd", header.payload_bytes))
                self.metrics.bytes_in.labels("ssd").inc(header.payload_bytes)
            for ns, records in by_ns.items():
                self.directory.publish(ns, records)
        return len(placed)

    def _quarantine_host(self, header: PageHeader, reason: str) -> None:
        logger.error("host tier: quarantining page %s: %s", header.key.hex(), reason)
        self._host_quarantine.append(Quarantined(header.key, header.namespace_id, reason, time.time()))
        self.metrics.quarantined.labels("host").inc()
        self.directory.remove(header.key, self.node, "host")

    def _quarantine_ssd(self, key: bytes) -> None:
        """Bookkeeping after SsdTier quarantined a page that failed a read check."""
        self._ssd_lru.pop(key, None)
        self.metrics.quarantined.labels("ssd").inc()
        self.directory.remove(key, self.node, "ssd")

    # -- writes through the arena --------------------------------------------------------

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes]) -> tuple[bytes, list[tuple[bytes, int | None]]]:
        """Reserves slots for the keys not stored yet; stops at the first that finds no room.

        Returns (allocation id, [(key, offset or None when already stored)]) for a prefix of
        ``keys``. The pages it calls stored are pinned until the commit (which may have to
        make them durable), abort or expiry. Raises TierFull when not even the first page fits.
        """
        with self._lock:
            self._reap()
            self._check_layout(namespace_id, layout)
            out: list[tuple[bytes, int | None]] = []
            slots: dict[bytes, int] = {}
            held: list[bytes] = []
            try:
                for key in keys:
                    if self._stored(key) or key in slots:
                        if key not in slots:
                            held.append(key)
                            self._pin([key])  # before the next reserve: it must not evict what we answer stored
                        out.append((key, None))
                        continue
                    self._learn(key)
                    offset = self._host_reserve(layout.page_bytes)
                    if offset is None:
                        break
                    slots[key] = offset
                    out.append((key, offset))
            except BaseException:
                for offset in slots.values():
                    self.host.unreserve(offset)
                self._unpin(held)
                raise
            if not out:
                raise TierFull("host tier is full and every page in it is leased")
            self._layouts.setdefault(namespace_id, layout)
            ident = secrets.token_bytes(16)
            deadline = time.monotonic() + self.config.allocation_ttl_ms / 1000
            self._allocations[ident] = Allocation(namespace_id, layout, slots, deadline, [k for k, _ in out], held)
            heapq.heappush(self._expiry, (deadline, ident, "alloc"))
            return ident, out

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int], durable: bool = False, flags: int = 0) -> int:
        """Publishes the written slots of an allocation; frees the others.

        Returns how many leading pages of the allocation's prefix (as ``allocate`` answered
        it, pages stored before included) are now stored. With ``durable`` every one of
        them, written now or stored earlier in RAM, is on the ssd tier (synced) when this
        returns and only those count; raises TierFull / TierUnavailable when the ssd tier
        refuses or fails (the pages stay in RAM), and TierUnavailable, storing nothing,
        when there is no ssd tier.
        """
        if len(keys) != len(checksums):  # before taking the allocation: it stays usable
            raise InvalidRequest(f"commit has {len(keys)} keys but {len(checksums)} checksums")
        flags &= ENGINE_FLAGS
        with self._lock:
            self._reap()
            alloc = self._allocations.pop(allocation_id, None)
            if alloc is None:
                raise LeaseExpired(f"allocation {allocation_id.hex()} is unknown or expired; allocate again")
            if durable and self.ssd is None:
                for reserved in alloc.slots.values():
                    self.host.unreserve(reserved)
                self._unpin(alloc.held)
                raise TierUnavailable("durable write asked of a server with no ssd tier (start it with --tiers host,ssd); "
                                      "nothing was stored")
            fresh: list[PageHeader] = []
            for key, csum in zip(keys, checksums):
                offset = alloc.slots.pop(key, None)
                if offset is None:
                    continue  # was stored already at allocation time
                header = PageHeader(alloc.namespace_id, key, alloc.layout, alloc.layout.page_bytes, csum, flags | (FLAG_WANTED if durable else 0))
                if self._stored(key) or self.host.contains(key):  # or removed, still read: it goes with its last pin
                    self.host.unreserve(offset)
                    continue
                self.host.install(header, offset)
                self._residency.add(key)
                fresh.append(header)
            for offset in alloc.slots.values():
                self.host.unreserve(offset)
            self._publish_host(alloc.namespace_id, fresh)
            run = self._leading(alloc.keys, self._stored)
            if durable:
                self._pin(run)
        try:
            if durable:
                self._write_through(run)
        finally:
            with self._lock:
                self._unpin(alloc.held + (run if durable else []))
        with self._lock:
            return len(self._leading(run, (lambda k: self._has(k, "ssd")) if durable else self._stored))

    @staticmethod
    def _leading(keys: list[bytes], held: Callable[[bytes], bool]) -> list[bytes]:
        """The leading keys for which ``held`` is true."""
        for i, key in enumerate(keys):
            if not held(key):
                return keys[:i]
        return keys

    def _publish_host(self, namespace_id: bytes, headers: list[PageHeader]) -> None:
        if headers:
            self.directory.publish(namespace_id, [(h.key, self.node, "host", h.payload_bytes) for h in headers])
            self.metrics.bytes_in.labels("host").inc(sum(h.payload_bytes for h in headers))

    def _write_through(self, keys: list[bytes]) -> None:
        """Copies pinned host pages to the ssd tier. Each page is verified on a helper thread
        while the pages are written (hashing and disk I/O overlap); a page damaged in the
        arena is quarantined and the batch is never synced nor indexed, so never persisted."""
        items = []
        for key in keys:
            slot = self.host.slot(key)
            if slot is None or self.ssd is None or self.ssd.contains(key):
                continue
            offset, header = slot
            items.append((header, self.host.view(offset, header.payload_bytes)))
        checks = [self._verifier.submit(_damage, header, view) for header, view in items]

        def verified() -> None:
            for (header, _), check in zip(items, checks):
                reason = check.result()
                if reason is not None:
                    with self._lock:
                        self._residency.remove(header.key)
                        self._quarantine_host(header, reason)
                        self._drop_local(header.key, "host")
                    raise PageCorrupt(reason)

        try:
            written = self._ssd_write(items, before_sync=verified) if items else 0
        except OSError as exc:
            raise TierUnavailable(
                f"durable write failed on the ssd tier ({exc.strerror or exc}); the pages are stored in RAM only"
            ) from exc
        if written < len(items):
            raise TierFull(
                "durable write refused: the ssd write budget (--ssd-dwpd) or the ssd tier is exhausted; "
                "the pages are stored in RAM only"
            )

    def abort(self, allocation_id: bytes) -> None:
        with self._lock:
            alloc = self._allocations.pop(allocation_id, None)
            if alloc is not None:
                for offset in alloc.slots.values():
                    self.host.unreserve(offset)
                self._unpin(alloc.held)

    # -- reads ---------------------------------------------------------------------------

    def acquire(self, namespace_id: bytes, keys: list[bytes], ttl_ms: int, learn: bool = True) -> tuple[bytes, list[AcquiredPage]]:
        """Leases the longest contiguous prefix of ``keys`` and makes it readable in the
        arena, promoting ssd pages into the host tier. A page that fails its check ends the
        prefix (and is quarantined). When the host tier cannot take more promoted pages the
        prefix ends early; the caller asks again for the rest.

        Disk reads run outside the lock: promoted pages get a reserved host slot and a pin
        first, and are installed (published) once read and verified.
        """
        ttl_ms = self._lease_ttl_ms(ttl_ms)  # before any pin is taken
        pages: list[AcquiredPage] = []
        promote: list[tuple[int, PageHeader]] = []  # (index in pages, header)
        with self._lock:
            self._reap()
            for key in keys:
                entry = self.directory.get(key)
                if entry is None or entry.namespace_id != namespace_id or not self._stored(key):
                    self.metrics.misses.labels("host").inc()
                    break
                slot = self.host.slot(key) if self._has(key, "host") else None
                if learn:
                    self._learn(key)
                if slot is not None:
                    self._residency.touch(key)
                    self.metrics.hits.labels("host").inc()
                    self._pin([key])
                    pages.append(AcquiredPage(key, slot[0], slot[1].checksum))
                    continue
                self.metrics.misses.labels("host").inc()
                assert self.ssd is not None
                header = self.ssd.header(key)
                assert header is not None
                self._pin([key])  # keeps the ssd copy while we make room and read it
                offset = self._host_reserve(header.payload_bytes)
                if offset is None:
                    self._unpin([key])
                    if pages:
                        break  # serve what is pinned; the caller asks again for the rest
                    raise TierFull("host tier is full and every page in it is leased; cannot promote from ssd")
                promote.append((len(pages), header))
                pages.append(AcquiredPage(key, offset, header.checksum))
        cut, reason = self._read_promoted(pages, promote)
        with self._lock:
            for index, header in promote:
                page = pages[index]
                if index < cut and self.directory.get(page.key) is None:
                    cut, reason = index, ""  # removed while we read it: do not resurrect it
                if index >= cut:
                    self.host.unreserve(page.offset)
                    continue
                existing = self.host.slot(page.key)
                if existing is not None:  # promoted concurrently by another reader
                    self.host.unreserve(page.offset)
                    pages[index] = AcquiredPage(page.key, existing[0], page.checksum)
                    continue
                self.host.install(header, page.offset)
                self._residency.add(page.key)
                self._ssd_lru.move_to_end(page.key)
                self.metrics.hits.labels("ssd").inc()
                self.metrics.bytes_out.labels("ssd").inc(header.payload_bytes)
                self.metrics.promotions.labels("ssd").inc()
                self.directory.publish(header.namespace_id, [(page.key, self.node, "host", header.payload_bytes)])
            bad = pages[cut].key if cut < len(pages) else None
            if bad is not None:
                self._unpin([p.key for p in pages[cut:]])
                pages = pages[:cut]
            for page in pages:
                self.metrics.bytes_out.labels("host").inc(self.layout_bytes(page.key))
            ident = secrets.token_bytes(16)
            self._lease_locked(ident, [p.key for p in pages], ttl_ms)
            if bad is not None and reason and self.ssd is not None and self.ssd.contains(bad):
                try:  # after the lease: a full index must not leave the served prefix pinned with no lease
                    self.ssd.quarantine(bad, reason)
                    self._quarantine_ssd(bad)
                except MetadataFull as exc:
                    logger.error("ssd tier: page %s failed its check but cannot be quarantined (%s); "
                                 "every read checks it again, so it is never served", bad.hex(), exc)
            return ident, pages

    def _read_promoted(self, pages: list[AcquiredPage], promote: list[tuple[int, PageHeader]]) -> tuple[int, str]:
        """Reads pages from ssd into their reserved host slots (no lock held), each verified
        as the helper thread copies it into place. Returns the index of the first page that
        failed (len(pages) if none) and why; nothing is installed before its check passed."""
        if not promote:
            return len(pages), ""
        assert self.ssd is not None
        items = [(pages[i].key, self.host.view(pages[i].offset, self.host.allocator.slot_bytes(pages[i].offset))) for i, _ in promote]
        failed, reason = self.ssd.read_pages(items, self._verifier)
        return (promote[failed][0] if failed < len(promote) else len(pages)), reason

    def layout_bytes(self, key: bytes) -> int:
        header = self.host.header(key)
        return header.payload_bytes if header else 0

    def read_view(self, key: bytes) -> tuple[PageHeader, memoryview]:
        """The bytes of a page acquired by the caller (valid until it releases)."""
        slot = self.host.slot(key)
        if slot is None:
            raise LeaseExpired(f"page {key.hex()} is no longer held; its lease was lost")
        offset, header = slot
        return header, self.host.view(offset, header.payload_bytes)

    def release(self, lease_id: bytes) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._unpin(lease.keys)
            return True

    def renew(self, lease_id: bytes, ttl_ms: int) -> None:
        """Extends a lease to ``ttl_ms`` from now (never shortens it), so that a reader
        holding pages for longer than one ttl keeps them pinned. Raises LeaseExpired when the
        lease was released or has expired (its pages may have been evicted and their slots
        reused). O(1): the lease's expiry entry moves on when it comes due."""
        ttl_ms = self._lease_ttl_ms(ttl_ms)
        with self._lock:
            self._reap()
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseExpired(f"lease {lease_id.hex()} was released or has expired; its pages may be gone")
            lease.expires = max(lease.expires, time.monotonic() + ttl_ms / 1000)

    def _lease_ttl_ms(self, ttl_ms: int) -> int:
        """The ttl a lease gets (0: the default); raises InvalidRequest beyond the maximum."""
        ttl_ms = ttl_ms or self.config.default_lease_ms
        if ttl_ms > self.config.max_lease_ms:
            raise InvalidRequest(f"lease ttl {ttl_ms} ms exceeds the maximum of {self.config.max_lease_ms} ms")
        return ttl_ms

    def _lease_locked(self, ident: bytes, keys: list[bytes], ttl_ms: int) -> float:
        ttl_ms = self._lease_ttl_ms(ttl_ms)
        deadline = time.monotonic() + ttl_ms / 1000
        self._leases[ident] = Lease(keys, deadline)
        heapq.heappush(self._expiry, (deadline, ident, "lease"))
        return time.time() + ttl_ms / 1000

    # -- directory operations ------------------------------------------------------------

    def hint(self, namespace_id: bytes, keys: list[bytes], eta_s: float, prefetch: bool = True) -> bool:
        """A queued request will need ``keys`` in about ``eta_s`` seconds.

        Eviction learns the announced use (hinted pages go last, furthest use first). Pages
        only on SSD are read into the host tier ahead of use if prefetch space is left
        within the hint share; the space is a reservation: when it is taken, nothing is
        read and False comes back at once, so the engine recomputes instead of waiting.
        """
        with self._lock:
            self._reap()
            eta = self.clock() + eta_s
            for depth, key in enumerate(keys):
                self._residency.hint(key, eta, depth)
            stored = self.directory.prefix_length(namespace_id, keys)
            todo = [k for k in keys[:stored] if not self._has(k, "host")] if prefetch else []
            layout = self._layouts.get(namespace_id)
            share = self._hint_share_pages(layout.page_bytes) if layout else 0
            if todo and len(self._residency.hinted) + len(todo) > share:
                self.metrics.hints.labels("refused").inc(len(keys))
                return False
            self.metrics.hints.labels("reserved").inc(len(keys))
        if todo:
            ident, _ = self.acquire(namespace_id, todo, 0, learn=False)
            self.release(ident)
        return True

    def lease(self, namespace_id: bytes, keys: list[bytes], ttl_ms: int) -> tuple[bytes, int, float]:
        """Pins the contiguous present prefix of ``keys`` in whatever tier holds it."""
        with self._lock:
            self._reap()
            found = self.directory.prefix_length(namespace_id, keys)
            held = keys[:found]
            ident = secrets.token_bytes(16)
            expires = self._lease_locked(ident, held, ttl_ms)
            self._pin(held)
            return ident, found, expires

    def publish_remote(self, namespace_id: bytes, records: list[tuple[bytes, str, str, int]]) -> list[int]:
        """Records pages held by other nodes (their bytes are durable there); all or none."""
        with self._lock:
            for _, node, _, _ in records:
                if node == self.node:
                    raise InvalidRequest(f"locations on this node ({node}) are published by its tiers, not by Publish")
            self.directory.check_remote_room(records, self.config.max_remote_records_per_node, self.config.max_remote_records)
            return self.directory.publish(namespace_id, records)

    def _drop_local(self, key: bytes, tier: str) -> None:
        """Frees this node's copy in ``tier`` now, or once its last pin goes."""
        if key in self._pins:
            self._doomed.add((key, tier))
        elif tier == "host" and self.host.delete(key):
            self._residency.remove(key)
        elif tier == "ssd" and self.ssd is not None and self.ssd.delete(key):
            self._ssd_lru.pop(key, None)

    def _delete_ssd_first(self, keys: list[bytes]) -> None:
        """Deletes the unpinned ssd copies of ``keys`` from the ssd index, in one transaction,
        before the directory forgets them: a full index (MetadataFull) refuses the removal
        with nothing changed, rather than pages gone from lookups that are back after a
        restart (rebuilt from the index)."""
        if self.ssd is None:
            return
        gone = [k for k in keys if k not in self._pins and self.ssd.contains(k)]
        self.ssd.delete_many(gone)
        for key in gone:
            self._ssd_lru.pop(key, None)

    def remove(self, namespace_id: bytes, keys: list[bytes], tier: str = "") -> int:
        """Removes pages (only their copies in ``tier`` when given); returns how many keys
        lost at least one location."""
        with self._lock:
            if tier in ("", "ssd"):
                ours = [k for k in keys if (e := self.directory.get(k)) is not None and e.namespace_id == namespace_id]
                self._delete_ssd_first(ours)
            count = 0
            for key in keys:
                entry = self.directory.get(key)
                if entry is None or entry.namespace_id != namespace_id:
                    continue
                gone = self.directory.remove(key, None, tier or None)
                if not gone:
                    continue
                count += 1
                for loc in gone:
                    if loc.node == self.node:
                        self._drop_local(key, loc.tier)
            self._refresh_gauges()
            return count

    def invalidate(self, namespace_id: bytes, keys: list[bytes]) -> int:
        """Keys given: removes them. None given: the whole namespace (one CLEARED event)."""
        if keys:
            return self.remove(namespace_id, keys)
        with self._lock:
            self._delete_ssd_first(self.directory.keys_of(namespace_id))
            removed = self.directory.clear_namespace(namespace_id)
            for key, _ in removed:
                self._drop_local(key, "host")
                self._drop_local(key, "ssd")
            self._layouts.pop(namespace_id, None)
            self._refresh_gauges()
            return len(removed)

    # -- scrub ---------------------------------------------------------------------------

    def scrub_one(self) -> bool | None:
        """Verifies the next SSD page (round robin) against its checksum, outside the lock;
        a page that fails is quarantined. Returns None when there is nothing to scrub."""
        if self.ssd is None:
            return None
        with self._lock:
            if not self._scrub_queue:
                self._scrub_queue = list(self._ssd_lru)
            key = None
            while self._scrub_queue:
                candidate = self._scrub_queue.pop()
                if self.ssd.contains(candidate):
                    key = candidate
                    break
            if key is None:
                return None
            self._pin([key])
            size = self.ssd.payload_bytes_of(key)
        if len(self._scrub_buf) < size + 4096:
            self._scrub_buf = bytearray(size + 4096)
        try:
            self.ssd.read(key, memoryview(self._scrub_buf)[:size])
            ok, reason = True, ""
        except PageCorrupt as exc:
            ok, reason = False, str(exc)
        except OSError as exc:
            ok, reason = True, ""  # an I/O error is not evidence of bad bytes; retried next round
            logger.warning("scrub: read of %s failed: %s", key.hex(), exc)
        with self._lock:
            self._unpin([key])
            self.metrics.scrubbed.inc()
            if not ok and self.ssd.contains(key):
                self.ssd.quarantine(key, f"scrub: {reason}")
                self._quarantine_ssd(key)
        return ok

    # -- reporting -----------------------------------------------------------------------

    def quarantined(self) -> list[Quarantined]:
        with self._lock:
            return list(self._host_quarantine) + (self.ssd.quarantined() if self.ssd else [])

    def purge_quarantine(self) -> int:
        with self._lock:
            n = len(self._host_quarantine) + (self.ssd.purge_quarantine() if self.ssd else 0)
            self._host_quarantine.clear()
            return n

    def _refresh_gauges(self) -> None:
        refresh_gauges(self)

    def usages(self) -> dict[str, TierUsage]:
        usages = {"host": self.host.usage()}
        if self.ssd is not None:
            usages["ssd"] = self.ssd.usage()
        return usages

    def stats(self) -> ManagerStats:
        with self._lock:
            self._reap()
            return collect_stats(self)

    def close(self) -> None:
        self._verifier.shutdown(wait=True)
        with self._lock:
            self.directory.close()
            self.host.close()
            if self.ssd is not None:
                self.ssd.close()
