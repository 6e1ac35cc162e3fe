"""The placement core: places pages in tiers, moves them on pressure and use, keeps the directory true.

A page is published only once its bytes are where its location says (landing: committed; lower: synced and indexed). Pinned
pages (leases, acquisitions, moves in flight) are never evicted or freed; a page removed while leased loses its lower copies
at once, its landing copy at its last unpin.

More: kvstore/server/placement/README.md (### core.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

from kvstore.config import ServerConfig
from kvstore.device_ops import PoolHandout
from kvstore.directory import Directory
from kvstore.errors import InvalidRequest, LeaseExpired, NamespaceMismatch, TierFull, TierUnavailable
from kvstore.page import ENGINE_FLAGS, FLAG_WANTED, LayoutDesc, PageHeader
from kvstore.server.admission import AdmissionPolicy, WriteBudget
from kvstore.server.leases import Allocation, LeaseTable
from kvstore.server.metrics import Metrics
from kvstore.server.placement.assembly import Wrap, gc_paused, open_directory, open_tiers
from kvstore.server.placement.generation_gate import GenerationGate
from kvstore.server.placement.housekeeping import Housekeeper
from kvstore.server.placement.moves import Mover
from kvstore.server.placement.reads import AcquiredPage, Reader
from kvstore.server.placement.removals import Removals
from kvstore.server.placement.reports import CoreReports
from kvstore.server.placement.residence import Residence, leading
from kvstore.server.placement.shares import NamespaceShares
from kvstore.server.placement.skips import NotAmong
from kvstore.server.placement.upper import Promoter
from kvstore.server.placement.watermarks import Watermarks
from kvstore.server.recovery import rebuild_directory
from kvstore.server.stats import Reporter
from kvstore.tiers.base import ArenaInfo, LandingPart
from kvstore.tiers.owner_parts import OwnerWords


class Placement(CoreReports):
    """An ``owner`` (``owner_of`` a namespace's; a handle's maker) is an opaque key the caller's side resolved
    (the server's gate: kvstore/server/tenancy/owners.py): it names an arena, a pool or a handle's maker and is
    compared only with other owners (``words``: how refusals name one). ``directory`` and ``leases``: made here
    unless the server made them first (its tenancy reads them); ``shares``: makes the namespaces' ssd shares
    from the ssd tier's write budget (None: none)."""

    def __init__(self, config: ServerConfig, metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic,
                 wrap: Wrap | None = None, policy: AdmissionPolicy | None = None,
                 owner_of: Callable[[bytes], str] | None = None, arena_bytes: Callable[[str], int] | None = None,
                 serving: Callable[[], bool] | None = None, directory: Directory | None = None,
                 leases: LeaseTable | None = None, shares: Callable[[WriteBudget | None], NamespaceShares] | None = None,
                 words: OwnerWords | None = None) -> None:
        self.config = config
        # whether this node may serve reads now (cluster mode: a member caught up with etcd's generations)
        self.serving = serving or (lambda: True)
        self.owner_of = owner_of or (lambda namespace_id: "")  # namespace -> the owner of the arena that holds its pages
        self.clock = clock
        self.node = config.node
        self.metrics = metrics or Metrics()
        with gc_paused():  # recovery: an object or two per stored page
            self.directory = open_directory(config) if directory is None else directory
            self.landing, self.lower, upper, orders = open_tiers(config, self.metrics, clock, wrap, policy, arena_bytes, words)
            self.leases = LeaseTable(config.default_lease_ms, config.max_lease_ms, config.allocation_ttl_ms) if leases is None else leases
            self.residence = Residence(self.landing, list(self.lower), self.leases, upper, orders)
            self.tiers = self.residence.tiers
            self.keeper = Housekeeper(self.residence, self.leases, self.lower, clock)
            self._lock = self.keeper.lock
            self.moves = Mover(self._lock, self.residence, self.lower, self.leases, self.directory, config.node, self.metrics,
                               self.keeper.settle_owed, None if shares is None else shares(self.lower[0].budget if self.lower else None))
            self._layouts: dict[bytes, LayoutDesc] = rebuild_directory(self.directory, self.node, self.tiers)
            self.reads = Reader(self.keeper, self.moves, self.directory, self.node, self.metrics, self._layouts.get, self.owner_of)
            self.promoter = Promoter(self.keeper, self.moves, self.directory, self.node, self.metrics, self.owner_of,
                                     self.reads.quarantine_landing)
            self.reporter = Reporter(self.node, self.directory, self.tiers, self.lower, self.metrics)
            self.removals = Removals(config, self.directory, self.keeper, self.reporter, self._layouts)
            self.generations = GenerationGate(self.directory, self.removals, self.serving, self.node)
            self.pressure = threading.Event()  # set when the landing tier fills past config.host.demote_above
            self.starved = self.moves.starved  # set when an allocation found no room: it evicted inline (demoter.py)
            self.watermarks = Watermarks(config.host.demote_above, config.host.demote_to)
            self.reporter.refresh_gauges()

    def arena_of(self, owner: str = "") -> ArenaInfo:
        """The arena ``owner``'s pages live in (made now at its first use: TierFull when the host cannot hold it)."""
        return self.landing.part(owner).arena

    def _check_layout(self, namespace_id: bytes, layout: LayoutDesc, arena: LandingPart) -> None:
        """Raises unless ``layout`` may be used in the namespace; binds nothing (allocate
        binds it once a slot was taken, so a rejected request leaves no binding)."""
        known = self._layouts.get(namespace_id, layout)
        if known != layout:
            raise NamespaceMismatch(f"namespace {namespace_id.hex()} has layout {known}, request says {layout}")
        if layout.page_bytes <= 0:
            raise InvalidRequest(f"layout {layout} gives an empty page or an unknown dtype")
        if layout.page_bytes > self.config.max_page_bytes:
            raise InvalidRequest(f"page of {layout.page_bytes} bytes exceeds the limit of {self.config.max_page_bytes}")
        if not arena.fits(layout.page_bytes):
            raise InvalidRequest(f"page of {layout.page_bytes} bytes does not fit a {self.landing.name} slab; raise --host-capacity")

    def _fill(self, arena: LandingPart) -> float:
        usage = arena.usage()
        return usage.used_bytes / usage.capacity_bytes if usage.capacity_bytes else 0.0

    # -- writes through the landing tier -------------------------------------------------

    def allocate(self, namespace_id: bytes, layout: LayoutDesc, keys: list[bytes],
                 owner: str = "", parent: bytes | None = None,
                 counting: AbstractContextManager[None] | None = None,
                 generation: int | None = None) -> tuple[bytes, list[tuple[bytes, int | None]]]:
        """Reserves landing slots for the keys not stored yet, under an allocation of ``owner``; stops at the first that
        finds no room (``counting``: around the lease table counting it, Quotas.handing_over). Returns (allocation id, [(key, slot or None when stored already)]) for a prefix of ``keys``; the
        pages it calls stored (and ``parent``, the key before keys[0], with no tier below) are pinned until commit, abort
        or expiry. Raises TierFull when not even the first page fits. The allocation belongs to the namespace's
        generation now (StaleGeneration when ``generation`` is given and is not it): its commit in another is refused."""
        self.generations.check_serving()
        arena = self.landing.part(self.owner_of(namespace_id))  # before the lock: it may be made now
        with self.keeper.critical():
            self.keeper.reap()
            self._check_layout(namespace_id, layout, arena)
            current = self.generations.require(namespace_id, generation)
            out: list[tuple[bytes, int | None]] = []
            alloc = Allocation(namespace_id, layout, {}, [], [], owner=owner, parent=parent, generation=current)
            slots, held = alloc.slots, alloc.held
            self.leases.hold_parent(alloc, keep=not self.lower)  # below, an eviction writes it down: findable
            try:
                for key in keys:
                    if key in slots or self.residence.stored(key):
                        if key not in slots:
                            held.append(key)
                            self.leases.pin([key])  # before the next reserve: it must not evict what we answer stored
                        out.append((key, None))
                        continue
                    self.keeper.learn(key)
                    slot = self.moves.make_room(layout.page_bytes, arena)
                    if slot is None:
                        break
                    slots[key] = slot
                    out.append((key, slot))
                if not out:
                    raise TierFull(f"{self.landing.name} tier is full and every page in it is leased")
            except BaseException:
                self.keeper.give_back(alloc)
                raise
            self._layouts.setdefault(namespace_id, layout)
            if self._fill(arena) > self.config.host.demote_above:
                self.pressure.set()
            alloc.keys = [k for k, _ in out]
            with counting or nullcontext():
                return self.leases.add_allocation(alloc), out

    def slot_view(self, allocation_id: bytes, key: bytes) -> memoryview:
        """Where the caller writes the page ``key`` of its allocation (LeaseExpired when the
        allocation is gone; InvalidRequest for a key it has no slot for)."""
        with self._lock:
            alloc = self.leases.allocation(allocation_id)
            if alloc is None:
                raise LeaseExpired(f"allocation {allocation_id.hex()} is unknown or expired; allocate again")
            slot = alloc.slots.get(key)
            if slot is None:
                raise InvalidRequest(f"allocation {allocation_id.hex()} has no slot for page {key.hex()}")
            return self.landing.at(slot).view(slot, alloc.layout.page_bytes)

    def commit(self, allocation_id: bytes, keys: list[bytes], checksums: list[int], durable: bool = False, flags: int = 0,
               owner: str | None = None, counting: AbstractContextManager[None] | None = None) -> int:
        """Publishes the written slots of an allocation; frees the others.  Returns how many leading pages of the allocation's
        prefix (as ``allocate`` answered it, pages stored before included) are now stored. With ``durable`` every one of
        them, written now or stored earlier in RAM, is in the first lower tier (synced) when this returns and only those
        count; raises TierFull / TierUnavailable when that tier refuses or fails (the pages stay in RAM), and
        TierUnavailable, storing nothing, when there is no lower tier. StaleGeneration when the namespace left the
        allocation's generation."""
        if len(keys) != len(checksums):  # before taking the allocation: it stays usable
            raise InvalidRequest(f"commit has {len(keys)} keys but {len(checksums)} checksums")
        self.moves.unchecked.forget(keys)  # a copy stored now came from no node unchecked, unless its fetch notes so after
        flags &= ENGINE_FLAGS
        with self.keeper.critical():
            self.keeper.reap()
            alloc = self.leases.take_allocation(allocation_id, owner)
            if alloc is None:
                raise LeaseExpired(f"allocation {allocation_id.hex()} is unknown or expired; allocate again")
            try:  # a node that may not serve stores nothing; a generation left since allocation: the bytes are dead
                self.generations.check_serving()
                self.generations.check_commit(alloc)
            except BaseException:
                self.keeper.give_back(alloc)
                raise
            if durable and not self.lower:
                self.keeper.give_back(alloc)
                raise TierUnavailable("durable write asked of a server with no ssd tier (start it with --tiers host,ssd); "
                                      "nothing was stored")
            fresh: list[tuple[int, PageHeader]] = []
            for key, csum in zip(keys, checksums):
                slot = alloc.slots.pop(key, None)
                if slot is None:
                    continue  # was stored already at allocation time
                if self.residence.stored(key):
                    self.landing.at(slot).unreserve(slot)
                    continue
                header = PageHeader(alloc.namespace_id, key, alloc.layout, alloc.layout.page_bytes, csum,
                                    flags | (FLAG_WANTED if durable else 0), alloc.generation)
                fresh.append((slot, header))
            if fresh:  # an allocation's slots are all in its namespace's owner's arena (allocate)
                self.landing.at(fresh[0][0]).commit(fresh, alloc.parents([h.key for _, h in fresh]))
            self.keeper.free_slots(list(alloc.slots.values()))
            with counting or nullcontext():  # the pages count from here (Quotas.handing_over: the caller's bridge goes)
                if fresh:
                    self.directory.publish(alloc.namespace_id, [(h.key, self.node, self.landing.name, h.payload_bytes) for _, h in fresh],
                                           alloc.generation)
            if fresh:
                self.metrics.bytes_in.labels(self.landing.name).inc(sum(h.payload_bytes for _, h in fresh))
            run = [] if self.leases.broken(alloc, self.residence.stored) else leading(alloc.keys, self.residence.stored)
            if durable:
                self.leases.pin(run)
        try:
            if durable:
                self.moves.write_through(run)
        finally:
            with self.keeper.critical():
                self.keeper.let_go(alloc, run if durable else [])
        with self._lock:
            return len(leading(run, (lambda k: self.residence.has(k, 1)) if durable else self.residence.stored))

    def abort(self, allocation_id: bytes, owner: str | None = None) -> None:
        """Gives back an allocation (of ``owner``, when given); an unknown one is a no-op."""
        with self.keeper.critical():
            alloc = self.leases.take_allocation(allocation_id, owner)
            if alloc is not None:
                self.keeper.give_back(alloc)

    def evict_own(self, namespace_ids: frozenset[bytes], keep_bytes: int, parent: bytes | None = None) -> bool:
        """Evicts (writing down) the coldest unpinned landing pages of ``namespace_ids`` down to ``keep_bytes``: a caller
        at its host quota makes room with its own pages, never another's; leaned chains in their turn, ``parent``'s too (the
        allocation to come names it, DESIGN §6). False when the rest is pinned. Each step removes or finds a pin."""
        directory, landing, skip = self.directory, self.landing.name, NotAmong(self.leases.kept, self.directory, namespace_ids)
        arena = self.landing.part(self.owner_of(next(iter(namespace_ids)))) if namespace_ids else None  # theirs
        with self.keeper.critical(), self.leases.leaning(parent):
            while (over := sum(directory.usage(ns).get(landing, 0) for ns in namespace_ids) > keep_bytes) \
                    and self.moves.evict_one(0, skip, arena):
                pass
            self.reporter.refresh_gauges()
        return not over

    # -- reads ---------------------------------------------------------------------------

    def acquire(self, namespace_id: bytes, keys: list[bytes], ttl_ms: int, learn: bool = True,
                owner: str = "", device: bool = False) -> tuple[bytes, list[AcquiredPage]]:
        """Leases (for ``owner``) the longest contiguous prefix of ``keys`` and makes it readable in the landing tier,
        reading pages held only below into it (reads.py); with ``device`` (an engine reads them on its device) also up into
        its owner's hbm pool (upper.py, ``placed``). Nothing while this node may not serve (``serving``): as for an empty
        namespace."""
        leased = self.reads.acquire(namespace_id, keys if self.serving() else [], ttl_ms, learn, owner)
        return self.promoter.promoted(*leased, device)

    def pool_of(self, owner: str = "") -> PoolHandout | None:
        """The hbm pool ``owner``'s engines map (made at first use: TierFull if it does not fit); None without hbm."""
        if self.promoter.index is None:
            return None
        return self.promoter.tier.part(owner).handout

    def read_view(self, page: AcquiredPage) -> memoryview:
        """The bytes of a page the caller acquired (valid until it releases)."""
        return self.landing.at(page.slot).view(page.slot, page.header.payload_bytes)

    def release(self, lease_id: bytes, owner: str | None = None) -> bool:
        """Ends a lease (of ``owner``, when given); False when there is no such lease."""
        with self.keeper.critical():
            free = self.leases.release(lease_id, owner)
            if free is None:
                return False
            self.residence.released(free)
            return True

    def renew(self, lease_id: bytes, ttl_ms: int, owner: str | None = None) -> None:
        """Extends a lease to ``ttl_ms`` from now (never shortens it); LeaseExpired when it
        was released or has expired (or is not ``owner``'s, when given)."""
        with self.keeper.critical():
            self.keeper.reap()
            self.leases.renew(lease_id, ttl_ms, owner)

    # -- directory operations ------------------------------------------------------------

    def hint(self, namespace_id: bytes, keys: list[bytes], eta_s: float, prefetch: bool = True) -> bool:
        """A queued request will need ``keys`` in about ``eta_s`` seconds (see reads.py)."""
        return self.reads.hint(namespace_id, keys, eta_s, prefetch)

    def hint_entries(self, namespace_id: bytes, entries: list[tuple[list[bytes], float]]) -> list[bool]:
        """``hint`` for each (keys, eta_s) entry, all announced or none (reads.py)."""
        return self.reads.hint_entries(namespace_id, entries)

    def lease(self, namespace_id: bytes, keys: list[bytes], ttl_ms: int, owner: str = "") -> tuple[bytes, int, float]:
        """Pins (for ``owner``) the contiguous present prefix of ``keys`` in whatever tier holds it."""
        with self.keeper.critical():
            self.keeper.reap()
            found = self.directory.prefix_length(namespace_id, keys) if self.serving() else 0
            ident, expires = self.leases.lease(keys[:found], ttl_ms, owner)
            return ident, found, expires

    def publish_remote(self, namespace_id: bytes, records: list[tuple[bytes, str, str, int]],
                       generation: int | None = None) -> list[int]:
        return self.removals.publish_remote(namespace_id, records, generation)

    def withdraw_remote(self, namespace_id: bytes, node: str, keys: list[bytes], tier: str = "") -> int:
        return self.removals.withdraw_remote(namespace_id, node, keys, tier)

    def remove(self, namespace_id: bytes, keys: list[bytes], tier: str = "") -> int:
        """Removes pages (only their copies in ``tier`` when given); see removals.py."""
        return self.removals.remove(namespace_id, keys, tier)

    def invalidate(self, namespace_id: bytes, keys: list[bytes]) -> int:
        """Keys given: removes them. None given: the whole namespace (its generation goes up by one: one CLEARED event)."""
        if keys:
            return self.removals.remove(namespace_id, keys)
        return self.enter_generation(namespace_id, self.directory.generation(namespace_id) + 1) or 0

    def read_generation(self, namespace_id: bytes, generation: int) -> None:
        """A node reads from here for its ``generation`` (generation_gate.py)."""
        self.generations.read(namespace_id, generation)

    def enter_generation(self, namespace_id: bytes, generation: int) -> int | None:
        """Raises the namespace to ``generation`` (removals.py): pages gone, None if it was there; never backwards."""
        return self.removals.enter_generation(namespace_id, generation)

    def enter_generations(self, raised: Mapping[bytes, int]) -> dict[bytes, int]:
        """``enter_generation`` of many namespaces in one synced LMDB transaction (DESIGN §12.5): pages dropped of each raised."""
        return self.removals.enter_generations(raised)

    # -- background work -----------------------------------------------------------------

    def demote_one(self) -> bool:
        """Writes a batch of the coldest pages of the fullest draining arena down (watermarks.py says which drain,
        moves.py how); False when none is, nothing can go, or there is no lower tier (eviction is in-memory work)."""
        with self.keeper.critical():
            arena = self.watermarks.next_part(self.landing.parts(), self._fill)
            if self.lower and arena is not None and self.moves.demote(arena, self.watermarks.low):
                return True
            self.pressure.clear()  # set again by the next allocation past the watermark
            return False

    def scrub_one(self) -> bool | None:
        """Verifies the next lower-tier page (see reads.py); None when there is none."""
        return self.reads.scrub_one()

    def close(self) -> None:
        self.moves.close()
        with self._lock:
            self.directory.close()
            for tier in self.tiers:
                tier.close()
