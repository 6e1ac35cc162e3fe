"""One page's locations (``Entry``) and the lookup's walk over a chain of keys without the
C build (``walk_python``: csrc/_lookup.c does the same walk, with the same answers)."""

from __future__ import annotations

from kvstore.types import REMOTE_TIER, TIER_NAMES, Location

DURABLE_TIERS = (REMOTE_TIER,)  # persisted by the directory; this node's ssd pages are rebuilt from the ssd index
TIER_ORDER = {name: rank for rank, name in enumerate(TIER_NAMES)}


class Entry:
    """One page's locations: (node, tier) -> Location. Slotted: a restart makes one per page.
    ``where`` caches (node, tier, size) of the best location for lookups; every change of
    ``locations`` resets it to None (under the directory's lock)."""

    __slots__ = ("locations", "namespace_id", "where")

    def __init__(self, namespace_id: bytes) -> None:
        self.namespace_id = namespace_id
        self.locations: dict[tuple[str, str], Location] = {}
        self.where: tuple[str, str, int] | None = None

    def best(self, local_node: str) -> Location:
        """The cheapest location: a local tier before a remote node, faster tiers first."""
        if len(self.locations) == 1:
            return next(iter(self.locations.values()))
        return min(self.locations.values(), key=lambda loc: (loc.node != local_node, TIER_ORDER.get(loc.tier, 9)))

    def durable(self) -> list[Location]:
        return [loc for loc in self.locations.values() if loc.tier in DURABLE_TIERS]


def walk_python(entries: dict[bytes, Entry], keys: list[bytes], namespace_id: bytes, start: int, runs: list[list],
                 *_: object) -> tuple[int, bool]:
    """kvstore._lookup.walk without the C build: the same walk, the same answers."""
    run, count = (runs[-1][0], runs[-1][1]) if runs else (None, 0)
    i, stopped = start, True
    for i in range(start, len(keys)):
        entry = entries.get(keys[i])
        if entry is None or entry.namespace_id != namespace_id:
            break
        where = entry.where
        if where is None:
            stopped = False
            break
        if where != run:
            if runs:
                runs[-1][1] = count
            runs.append([where, 0])
            run, count = where, 0
        count += 1
    else:
        i = max(start, len(keys))
    if runs:
        runs[-1][1] = count
    return i, stopped
