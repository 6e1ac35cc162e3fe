"""What callers make the server hold for them: pins, leases, allocations, and their expiry.

More: kvstore/server/README.md (### leases.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

from kvstore.errors import InvalidRequest, LeaseExpired
from kvstore.page import LayoutDesc

logger = logging.getLogger(__name__)

HANDLE_BYTES = 16
_MOVES_ENDED = itertools.count()  # Pins.moves_ended: one value a Pins and a move's end


class Pins(Counter[bytes]):
    """Every pin, a caller's or a move's, counted: the keys an eviction order's ``victim``
    passes over; ``moving``: the pins of moves. A page pinned by a caller keeps the pages
    before it in its prefix (chains.py); one being moved down does not (its predecessor may
    follow it down): a victim search walks through it, to what was committed after it."""

    def __init__(self) -> None:
        super().__init__()
        self._moving: Counter[bytes] = Counter()
        self.moves_ended = next(_MOVES_ENDED)

    @property
    def moving(self) -> Mapping[bytes, int]:
        """The pins of moves, read-only (changed through ``pin_moves`` / ``unpin_moves``)."""
        return MappingProxyType(self._moving)

    def pin_moves(self, keys: Iterable[bytes]) -> None:
        self._moving.update(keys)

    def unpin_moves(self, keys: Iterable[bytes]) -> None:
        """``moves_ended`` changes (no two ``Pins`` share a value): a page that was being moved
        may be followed again by a walk (a round's shortcut down a chain is stale: chains.py)."""
        self._moving.subtract(keys)
        self._moving = +self._moving  # drops the zeros
        self.moves_ended = next(_MOVES_ENDED)


class PinsAnd:
    """Pins and the parents open allocations lean on (``Leases.kept``): a ``Pins`` for a
    victim search (its ``moving`` too), which passes over both, then walks the chains kept
    only by leaning over ``pins`` alone in their turn (eviction.py ``_passes``, DESIGN §6);
    ``pins`` alone too where leaning keeps nothing (an orphan's chain: its head is gone)."""

    def __init__(self, pins: Pins, leaned: Counter[bytes]) -> None:
        self.pins, self._leaned = pins, leaned

    def __contains__(self, key: object) -> bool:
        return key in self.pins or key in self._leaned

    @property
    def moving(self) -> Mapping[bytes, int]:
        return self.pins.moving

    @property
    def moves_ended(self) -> int:
        return self.pins.moves_ended


@dataclass
class Allocation:
    """A writer's reservation: slots in the landing tier for the keys not stored yet."""

    namespace_id: bytes
    layout: LayoutDesc
    slots: dict[bytes, int]       # key -> reserved slot in the landing tier
    keys: list[bytes]             # the prefix allocate answered: stored already or reserved
    held: list[bytes]             # the keys stored already, pinned until commit/abort/expiry
    expires: float = field(default=0.0)
    owner: str = ""               # who made it (opaque): only that owner may commit or abort it
    parent: bytes | None = None   # the page before keys[0] in its prefix, when the writer named it
    parent_held: bool = False     # ``parent`` is pinned until commit/abort/expiry (hold_parent)
    parent_leaned: bool = False   # ``parent`` is kept while other pages can go, until commit/abort/expiry
    generation: int = 0           # the namespace's generation at allocation: a commit in another is refused
    session_id: str = ""          # the session whose pages these are (AllocateRequest.session_id): refused once it is fenced

    def parents(self, keys: list[bytes]) -> list[bytes | None]:
        """The page before each of ``keys`` in its prefix, when known."""
        before = dict(zip(self.keys, [self.parent, *self.keys]))
        return [before.get(key) for key in keys]


@dataclass
class LeaseEntry:
    keys: list[bytes]
    expires: float
    owner: str = ""  # who took it (opaque): only that owner may renew or release it


@dataclass(frozen=True)
class LeaseCounts:
    """A read-only picture of what callers hold (for stats and tests)."""

    num_leases: int
    num_allocations: int
    num_expiry_entries: int
    pinned: frozenset[bytes]  # by callers: leases, allocations, acquisitions under way
    moving: frozenset[bytes]  # by the server's own moves in flight (demotion, deletion)
    lease_ids: frozenset[bytes]
    leaned: frozenset[bytes] = frozenset()  # parents open allocations lean on (``LeaseTable.leaned``)


class LeaseTable:
    """Each handle keeps one owner: an opaque key its caller's side resolved (the server's:
    kvstore/server/tenancy/owners.py), compared only with other owners; ``held`` and
    ``slot_bytes`` count what each owner holds."""

    def __init__(self, default_lease_ms: int, max_lease_ms: int, allocation_ttl_ms: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.default_lease_ms = default_lease_ms
        self.max_lease_ms = max_lease_ms
        self.allocation_ttl_ms = allocation_ttl_ms
        self.clock = clock
        self.pins = Pins()  # every pin, a caller's or a move's (``pins.moving``: the moves')
        self.leaned: Counter[bytes] = Counter()  # parents open allocations keep while other pages can go
        self.kept = PinsAnd(self.pins, self.leaned)  # what an eviction passes over first
        self._leases: dict[bytes, LeaseEntry] = {}
        self._allocations: dict[bytes, Allocation] = {}
        self._expiry: list[tuple[float, bytes, bool]] = []  # (deadline, handle, is_lease)
        self._held: Counter[tuple[str, bool]] = Counter()  # (owner, is_lease) -> how many it holds
        self._slot_bytes: Counter[str] = Counter()  # owner -> landing bytes its allocations' slots hold

    # -- pins ----------------------------------------------------------------------------

    def pin(self, keys: list[bytes], move: bool = False) -> None:
        """``move``: the pin of the server's own move (writing a page down, deleting a copy)."""
        self.pins.update(keys)
        if move:
            self.pins.pin_moves(keys)

    def unpin(self, keys: list[bytes], move: bool = False) -> list[bytes]:
        """Drops one pin of each key; returns the keys that are no longer pinned at all."""
        if move:
            self.pins.unpin_moves(keys)
        pins = self.pins
        pins.subtract(keys)
        free = []
        for key in keys:
            if key in pins and pins[key] <= 0:
                del pins[key]
                free.append(key)
        return free

    def pinned(self, key: bytes) -> bool:
        return key in self.pins

    def moving(self, key: bytes) -> bool:
        """Whether a move of the server's own (a promotion, demotion, scrub or delete) holds ``key``."""
        return key in self.pins.moving

    # -- leases --------------------------------------------------------------------------

    def lease_ttl_ms(self, ttl_ms: int) -> int:
        """The ttl a lease gets (0: the default); raises InvalidRequest beyond the maximum.
        Called before any pin is taken, so a refused request holds nothing."""
        ttl_ms = ttl_ms or self.default_lease_ms
        if ttl_ms > self.max_lease_ms:
            raise InvalidRequest(f"lease ttl {ttl_ms} ms exceeds the maximum of {self.max_lease_ms} ms")
        return ttl_ms

    def lease(self, keys: list[bytes], ttl_ms: int, owner: str = "") -> tuple[bytes, float]:
        """Pins ``keys`` under a new lease of ``owner``; returns its handle and its expiry (unix seconds)."""
        ttl_ms = self.lease_ttl_ms(ttl_ms)
        ident = secrets.token_bytes(HANDLE_BYTES)
        deadline = self.clock() + ttl_ms / 1000
        self._leases[ident] = LeaseEntry(keys, deadline, owner)
        self._held[(owner, True)] += 1
        heapq.heappush(self._expiry, (deadline, ident, True))
        self.pin(keys)
        return ident, time.time() + ttl_ms / 1000

    def _lease_of(self, ident: bytes, owner: str | None) -> LeaseEntry | None:
        lease = self._leases.get(ident)
        return lease if lease is not None and (owner is None or lease.owner == owner) else None

    def keys_of(self, ident: bytes, owner: str | None = None) -> list[bytes] | None:
        """The keys a lease (of ``owner``, when given) pins; None when there is no such lease."""
        lease = self._lease_of(ident, owner)
        return None if lease is None else list(lease.keys)

    def release(self, ident: bytes, owner: str | None = None) -> list[bytes] | None:
        """Ends a lease; returns its keys no longer pinned, or None when there is no such lease
        (of ``owner``, when given)."""
        if self._lease_of(ident, owner) is None:
            return None
        lease = self._leases.pop(ident)
        self._held[(lease.owner, True)] -= 1
        return self.unpin(lease.keys)

    def renew(self, ident: bytes, ttl_ms: int, owner: str | None = None) -> None:
        """Moves a lease's or an allocation's expiry to ``ttl_ms`` from now (never back).
        Raises LeaseExpired when it was released, committed or has expired (its pages may have
        been evicted, its slots given to another writer, meanwhile), or is not ``owner``'s."""
        alloc = self._allocations.get(ident)
        if alloc is not None and (owner is None or alloc.owner == owner):  # a layer-wise save's slots
            ttl_ms = ttl_ms or self.allocation_ttl_ms
            if ttl_ms > max(self.max_lease_ms, self.allocation_ttl_ms):
                raise InvalidRequest(f"allocation ttl {ttl_ms} ms exceeds the maximum of "
                                     f"{max(self.max_lease_ms, self.allocation_ttl_ms)} ms")
            alloc.expires = max(alloc.expires, self.clock() + ttl_ms / 1000)
            return
        ttl_ms = self.lease_ttl_ms(ttl_ms)
        lease = self._lease_of(ident, owner)
        if lease is None:
            raise LeaseExpired(f"lease {ident.hex()} was released or has expired; its pages may be gone")
        lease.expires = max(lease.expires, self.clock() + ttl_ms / 1000)

    # -- allocations ---------------------------------------------------------------------

    def add_allocation(self, alloc: Allocation) -> bytes:
        """Records an allocation (its ``held`` keys are pinned already); returns its handle."""
        ident = secrets.token_bytes(HANDLE_BYTES)
        alloc.expires = self.clock() + self.allocation_ttl_ms / 1000
        self._allocations[ident] = alloc
        self._held[(alloc.owner, False)] += 1
        self._slot_bytes[alloc.owner] += len(alloc.slots) * alloc.layout.page_bytes
        heapq.heappush(self._expiry, (alloc.expires, ident, False))
        return ident

    def hold_parent(self, alloc: Allocation, keep: bool = True) -> None:
        """With ``keep``, pins the page the allocation names as its parent (stored or not yet:
        an earlier batch may commit later) until ``let_go``: the pages after it are written
        meanwhile, and a prefix lookup finds nothing after a missing page. The pin keeps the
        whole chain before it too, as a reader's pin does. Without ``keep`` (a tier below: an
        eviction writes the chain down, still findable, and a put may outgrow RAM) the parent
        is only leaned on: ``kept`` holds it, evictions take the other probation pages first,
        so a put does not write its own head down to make room for its next batch."""
        if alloc.parent is None or alloc.parent_held or alloc.parent_leaned:
            return
        if keep:
            self.pin([alloc.parent])
            alloc.parent_held = True
        else:
            self.lean(alloc.parent)
            alloc.parent_leaned = True

    def lean(self, key: bytes) -> None:
        """``key`` is kept while other pages can go (``kept``) until ``unlean``: the parent of an
        open allocation, or of one about to be made (a tenant's room at its quota, DESIGN §6)."""
        self.leaned[key] += 1

    def unlean(self, key: bytes) -> None:
        self.leaned[key] -= 1
        if self.leaned[key] <= 0:
            del self.leaned[key]

    @contextmanager
    def leaning(self, key: bytes | None) -> Iterator[None]:
        """``lean`` on ``key`` (when given) for the block."""
        if key is None:
            yield
            return
        self.lean(key)
        try:
            yield
        finally:
            self.unlean(key)

    def let_go(self, alloc: Allocation) -> list[bytes]:
        """Drops the pins an allocation holds (its stored keys, its parent); returns the keys
        no longer pinned at all. Once only: commit, abort and expiry each take the allocation."""
        keys, alloc.held = alloc.held, []
        if alloc.parent is not None and alloc.parent_leaned:
            self.unlean(alloc.parent)
            alloc.parent_leaned = False
        if alloc.parent is not None and alloc.parent_held:
            keys, alloc.parent_held = [*keys, alloc.parent], False
        return self.unpin(keys)

    def broken(self, alloc: Allocation, stored: Callable[[bytes], bool]) -> bool:
        """Whether the page before the allocation's (``parent``) is gone: evicted while this
        batch was written, not merely committed later by a live allocation. Then none of the
        allocation's pages can be found (lookups are prefix lookups)."""
        parent = alloc.parent
        return parent is not None and not stored(parent) and not any(parent in a.slots for a in self._allocations.values())

    def allocation(self, ident: bytes) -> Allocation | None:
        return self._allocations.get(ident)

    def take_allocation(self, ident: bytes, owner: str | None = None) -> Allocation | None:
        """Removes and returns an allocation (None: unknown, expired, or not ``owner``'s when
        given); the caller frees its slots and unpins its ``held`` keys."""
        alloc = self._allocations.get(ident)
        if alloc is None or (owner is not None and alloc.owner != owner):
            return None
        self._held[(alloc.owner, False)] -= 1
        self._slot_bytes[alloc.owner] -= len(alloc.slots) * alloc.layout.page_bytes
        return self._allocations.pop(ident)

    # -- expiry --------------------------------------------------------------------------

    def expired(self) -> tuple[list[bytes], list[Allocation]]:
        """Ends what is past its deadline: returns the keys no longer pinned (from expired
        leases) and the expired allocations, whose slots and pins the caller gives back."""
        now = self.clock()
        free: list[bytes] = []
        allocations: list[Allocation] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, ident, is_lease = heapq.heappop(self._expiry)
            if is_lease:
                lease = self._leases.get(ident)
                if lease is not None and lease.expires > now:  # renewed: its one entry moves on
                    heapq.heappush(self._expiry, (lease.expires, ident, True))
                elif lease is not None:
                    del self._leases[ident]
                    self._held[(lease.owner, True)] -= 1
                    logger.warning("lease %s expired with %d pages pinned", ident.hex()[:8], len(lease.keys))
                    free += self.unpin(lease.keys)
            else:
                alloc = self._allocations.get(ident)
                if alloc is not None and alloc.expires > now:  # renewed: its one entry moves on
                    heapq.heappush(self._expiry, (alloc.expires, ident, False))
                elif alloc is not None:
                    del self._allocations[ident]
                    self._held[(alloc.owner, False)] -= 1
                    self._slot_bytes[alloc.owner] -= len(alloc.slots) * alloc.layout.page_bytes
                    logger.warning("allocation %s expired uncommitted; freeing %d slots", ident.hex()[:8], len(alloc.slots))
                    allocations.append(alloc)
        return free, allocations

    def held(self, owner: str) -> tuple[int, int]:
        """(leases, allocations) ``owner`` holds now (a dict read: callers need no lock)."""
        return self._held.get((owner, True), 0), self._held.get((owner, False), 0)

    def slot_bytes(self, owner: str) -> int:
        """Landing bytes the slots of ``owner``'s allocations hold (a dict read, as ``held``)."""
        return self._slot_bytes.get(owner, 0)

    def counts(self) -> LeaseCounts:
        moving = self.pins.moving
        callers = frozenset(k for k, n in self.pins.items() if n > moving.get(k, 0))
        return LeaseCounts(len(self._leases), len(self._allocations), len(self._expiry), callers, frozenset(moving),
                           frozenset(self._leases), frozenset(self.leaned))
