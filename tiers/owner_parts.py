"""A tier as a map of its parts, one per owner (an opaque string, compared only with other owners):
the host arenas (arenas.py) and hbm pools (pools.py); a tier of one part, or a lower tier, one part.

The map forwards no storage call: the core asks a part, found by owner (``part``), by slot (``at``:
part ``i`` numbers its slots from ``i << PART_BITS``) or by key (``part_of``: a dict the parts' events
keep, not a question to every part); the map sums what is about every part (``usage``...). A part is
made at its owner's first use, then wrapped (``wrap``: fault injection in tests), and lives as long
as the server; ``words`` name its owner in logs and refusals. Thread-safety: each part guards itself;
the parts only grow (under ``_lock``); key notes are written under each part's lock, one dict op each.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvstore.tiers.base import UNOWNED, NoEvents, Quarantined, StoreEvents, TierUsage

logger = logging.getLogger(__name__)

PART_BITS = 40  # a part holds at most 1 TiB; slot >> PART_BITS is its part

P = TypeVar("P", bound=Any)  # a Tier: a HostTier, an HbmTier, a lower tier (or a wrapper of one)


@dataclass(frozen=True)
class OwnerWords:
    """How logs and refusals name an owner's part, and what sizes an owner's arena: the words of
    whoever maps callers to owners (the server's: kvstore/server/tenancy/owners.py)."""

    named: Callable[[str], str] = repr  # "no arena for <named(owner)>"
    sized_by: str = "the size asked for it"  # what an operator lowers when an owner's arena does not fit


class _Noted:
    """A part's events, and the map's note of which owner's part holds each key (written first)."""

    __slots__ = ("_held", "_inner", "_owner")

    def __init__(self, inner: StoreEvents, held: dict[bytes, str], owner: str) -> None:
        self._inner, self._held, self._owner = inner, held, owner

    def stored(self, key: bytes, parent: bytes | None) -> None:
        self._held[key] = self._owner
        self._inner.stored(key, parent)

    def removed(self, key: bytes, evicted: bool) -> None:
        if self._held.get(key) == self._owner:
            del self._held[key]
        self._inner.removed(key, evicted)


class OwnerParts(Generic[P]):
    """A tier's parts by owner (see the module docstring). ``single``: one part for every owner,
    made by the subclass at start (or given: ``one``)."""

    what = "part"  # named in logs and errors

    def __init__(self, name: str, single: bool, wrap: Callable[[P], P] | None = None,
                 words: OwnerWords | None = None) -> None:
        self.name = name
        self.single = single
        self.words = words or OwnerWords()
        self._wrap = wrap
        self._parts: list[P] = []
        self._by_owner: dict[str, P] = {}
        self._held: dict[bytes, str] = {}  # key -> the owner of the part that holds it (several parts only)
        self._lock = threading.Lock()

    @classmethod
    def one(cls, part: P) -> OwnerParts[P]:
        """A map of one part made elsewhere (a lower tier)."""
        parts: OwnerParts[P] = cls(part.name, single=True)
        parts._parts.append(part)
        parts._by_owner[UNOWNED] = part
        return parts

    def _make(self, owner: str, base: int) -> P:
        """A new part whose slots are numbered from ``base``; TierFull when it cannot be made."""
        raise NotImplementedError

    def _events(self, owner: str, events: StoreEvents | None) -> StoreEvents | None:
        """What ``owner``'s new part tells: ``events``, and (several parts) the map which part holds each key."""
        return events if self.single else _Noted(events or NoEvents(), self._held, owner)

    # -- finding a part ------------------------------------------------------------------

    def part(self, owner: str) -> P:
        """``owner``'s part, made now at its first use (TierFull when it cannot be made)."""
        owner = UNOWNED if self.single else owner
        found = self._by_owner.get(owner)
        if found is not None:
            return found
        with self._lock:
            found = self._by_owner.get(owner)
            if found is None:
                found = self._make(owner, len(self._parts) << PART_BITS)
                if self._wrap is not None:
                    found = self._wrap(found)
                self._parts.append(found)
                self._by_owner[owner] = found
                logger.info("%s %d made for %s", self.what, len(self._parts) - 1, self.words.named(owner))
            return found

    def parts(self) -> list[P]:
        return list(self._parts)

    def at(self, slot: int) -> P:
        """The part ``slot`` is in."""
        return self._parts[slot >> PART_BITS]

    def part_of(self, key: bytes) -> P | None:
        """The part that holds ``key`` (None: none does). A map of one part answers that part,
        which answers for the key itself (a miss is its value)."""
        if self.single:
            return self._parts[0]
        owner = self._held.get(key)
        return None if owner is None else self._by_owner[owner]

    # -- every part ----------------------------------------------------------------------

    def usage(self) -> TierUsage:
        usages = [part.usage() for part in self.parts()]
        return TierUsage(sum(u.num_pages for u in usages), sum(u.used_bytes for u in usages),
                         sum(u.capacity_bytes for u in usages))

    def quarantined(self, purge: bool = False) -> list[Quarantined]:
        return [q for part in self.parts() for q in part.quarantined(purge)]

    def stored_keys(self) -> list[bytes]:
        return [key for part in self.parts() for key in part.stored_keys()]

    def close(self) -> None:
        for part in self.parts():
            part.close()
