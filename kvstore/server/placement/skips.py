"""What an eviction for some namespaces passes over (a tenant's room at its quota, its SSD
share): the pins, and every page of another namespace.

More: kvstore/server/placement/README.md (### skips.py).
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.directory import Directory


class NotAmong:
    """The keys an eviction for some namespaces passes over: pinned ones (or ``Leases.kept``),
    and every page of another namespace (read from the directory: no tier lock is taken)."""

    def __init__(self, pins: Container[bytes], directory: Directory, namespace_ids: frozenset[bytes]) -> None:
        self._pins, self._directory, self._namespace_ids = pins, directory, namespace_ids

    @property
    def pins(self) -> NotAmong:
        """The same over the pins alone, without what open allocations lean on: what an
        orphan's chain passes over (eviction._loose, DESIGN §6)."""
        loose = getattr(self._pins, "pins", None)
        return self if loose is None else NotAmong(loose, self._directory, self._namespace_ids)

    @property
    def moving(self) -> Container[bytes]:
        """The pages being moved down (``Pins.moving``): walked through, never named (chains.py)."""
        return getattr(self._pins, "moving", ())

    @property
    def moves_ended(self) -> int | None:
        """``Pins.moves_ended`` (None: not known, so a round's shortcut is not taken)."""
        return getattr(self._pins, "moves_ended", None)

    def __contains__(self, key: object) -> bool:
        if key in self._pins:
            return True
        entry = self._directory.get(key)  # type: ignore[arg-type]
        return entry is None or entry.namespace_id not in self._namespace_ids
