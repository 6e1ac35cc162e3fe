"""What every tier offers the placement core: one small, batch-first protocol.

The core keeps an ordered list of tiers (the first is where pages land, the rest are where
they are demoted to) and calls them only through ``Tier``; what is special about a tier is
its type (``LandingTier``: memory that clients map), or a wrapper around it (admission and
a write budget, fault injection), never a branch on its name.

More: tiers/README.md (### base.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvstore.page import PageHeader

UNOWNED = ""  # the owner of pages no one owns (and of the one part of a tier without owners)


def parent_links(parents: Sequence[bytes | None], num_pages: int) -> list[bytes | None]:
    """Each page's parent for a ``commit`` of ``num_pages`` pages: ``parents`` as given, or
    None for every page when none are. Raises ValueError (nothing stored) for another number
    of parents: zipped with the pages, the pages past the shorter list would be dropped."""
    if not parents:
        return [None] * num_pages
    if len(parents) != num_pages:
        raise ValueError(f"{len(parents)} parents for {num_pages} pages")
    return list(parents)


@dataclass(frozen=True)
class TierUsage:
    num_pages: int
    used_bytes: int
    capacity_bytes: int


# One page a tier's index holds, as ``recover`` lists it: (key, namespace_id, payload_bytes,
# generation). A plain tuple: a restart makes one per stored page.
StoredPage = tuple[bytes, bytes, int, int]


@dataclass(frozen=True)
class Quarantined:
    """A page that failed a check: dropped from its tier, kept on this list for operators."""

    key: bytes
    namespace_id: bytes
    reason: str
    unix_s: float


@dataclass(frozen=True)
class ReadResult:
    """How far a batch read got: pages ``[0, num_read)`` are in their buffers, verified.
    ``reason`` says why page ``num_read`` failed when it was damaged (empty for a miss or
    an I/O error, which prove nothing about the bytes)."""

    num_read: int
    reason: str = ""


@dataclass(frozen=True)
class ArenaInfo:
    """What a client needs to map a landing tier's memory: its path (empty: it has none and
    is handed over as ``fd``, a descriptor the tier owns), its size and the token it starts with."""

    path: str
    size_bytes: int
    token: bytes
    fd: int = -1


class StoreEvents(Protocol):
    """What a tier tells of what it stores (the module docstring): the placement core's
    eviction order of the tier (or of one part of it). Called under the tier's lock, so it
    never blocks and never calls back into the tier."""

    def stored(self, key: bytes, parent: bytes | None) -> None:
        """``key`` was committed (again: its new copy replaces the old); ``parent``: the page
        before it in its prefix, when its writer named it."""
        ...

    def removed(self, key: bytes, evicted: bool) -> None:
        """``key`` left the tier (``evicted``: to make room, as its ``delete`` was told)."""
        ...


class NoEvents:
    """Events nobody listens to (a tier opened on its own: tests, tools)."""

    def stored(self, key: bytes, parent: bytes | None) -> None:
        pass

    def removed(self, key: bytes, evicted: bool) -> None:
        pass


class Tier(Protocol):
    """The storage contract (the module docstring)."""

    name: str

    def reserve(self, payload_bytes: int) -> int | None: ...

    def unreserve(self, slot: int) -> None: ...

    def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        """Puts each (slot, header, payload) into its reserved slot, in as few calls to the
        device as the tier can make of them. On an error some may have been written (none is
        stored before its ``commit``: the slots stay reserved and unindexed)."""
        ...

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        """Makes written slots the stored pages; ``parents``: each page's predecessor in its
        prefix when known, told to the tier's events (the eviction order gives up a chain's
        tail first; a durable tier keeps them in its index for a restart)."""

    def read_into(self, pages: list[tuple[bytes, memoryview]], verify: bool = True) -> ReadResult: ...

    def contains(self, key: bytes) -> bool: ...

    def find(self, key: bytes) -> tuple[int, PageHeader] | None:
        """Where the tier keeps ``key`` (its slot: an arena or file offset) and the page's
        header; None when it does not hold it, or (a durable tier) its index entry is damaged."""
        ...

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        """Drops the copies of ``keys``; returns how many it held. ``evicted``: they go to
        make room (told to the tier's events: an order may remember them as recently evicted)."""
        ...

    def quarantine(self, key: bytes, reason: str) -> None:
        """Drops a page that failed a check and lists it (``quarantined``) with ``reason``."""
        ...

    def quarantined(self, purge: bool = False) -> list[Quarantined]:
        """The pages quarantined (``purge``: the list is emptied; those it held come back)."""
        ...

    def stored_keys(self) -> list[bytes]:
        """The keys held (the scrub walks them)."""
        ...

    def recover(self) -> list[StoredPage]: ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None: ...


@runtime_checkable
class LandingTier(Tier, Protocol):
    """Where pages land: memory that clients map and fill or read in place (a host arena; the
    landing tier is a map of them by owner, tiers/owner_parts.py).

    The core hands out its slots (``view``) to writers it allocated them to and to readers it
    leased pages to. Every method is an in-memory operation (none blocks on I/O), so the core
    may call any of them under its own lock.
    """

    arena: ArenaInfo

    def view(self, slot: int, nbytes: int) -> memoryview: ...

    def offset(self, slot: int) -> int:
        """Where ``slot`` lies in the arena a client maps (the byte offset it is told)."""
        ...

    def detach(self, key: bytes) -> int | None:
        """Drops ``key`` from the index but keeps its slot reserved (returned; None: not
        held): a reader the page was leased to still finds its bytes there, while the key
        may be stored again in another slot. The caller unreserves the slot later."""
        ...

    def slot_bytes(self, slot: int) -> int: ...

    def fits(self, page_bytes: int) -> bool:
        """Whether a page of ``page_bytes`` fits one slot at all."""
        ...


class LandingPart(LandingTier, Protocol):
    """One owner's part of the landing tier (an owner's arena, or the one arena of a tier for
    every owner): ``owner`` (UNOWNED: every owner's) names its eviction order in the core."""

    owner: str


class TierWrapper:
    """Delegates every ``Tier`` method to ``inner``: the base of cross-cutting wrappers
    (fault injection, admission), which override what they change. Attributes beyond the
    protocol (a landing tier's ``view``...) are looked up on ``inner`` too."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def reserve(self, payload_bytes: int) -> int | None:
        return self.inner.reserve(payload_bytes)

    def unreserve(self, slot: int) -> None:
        self.inner.unreserve(slot)

    def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        self.inner.write(pages)

    def commit(self, pages: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        self.inner.commit(pages, parents)

    def read_into(self, pages: list[tuple[bytes, memoryview]], verify: bool = True) -> ReadResult:
        return self.inner.read_into(pages, verify)

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def find(self, key: bytes) -> tuple[int, PageHeader] | None:
        return self.inner.find(key)

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        return self.inner.delete(keys, evicted)

    def quarantine(self, key: bytes, reason: str) -> None:
        self.inner.quarantine(key, reason)

    def quarantined(self, purge: bool = False) -> list[Quarantined]:
        return self.inner.quarantined(purge)

    def stored_keys(self) -> list[bytes]:
        return self.inner.stored_keys()

    def recover(self) -> list[StoredPage]:
        return self.inner.recover()

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def close(self) -> None:
        self.inner.close()
