"""Removing pages and namespaces, and other nodes' records: the directory changes that
free this node's copies. Lower-tier copies go first (a full index refuses the whole
removal with nothing changed), then the directory entries (the directory's own locks),
then, under the core's lock, the landing copies (at their last unpin when leased)."""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.config import ServerConfig
from kvstore.directory import Directory
from kvstore.errors import InvalidRequest
from kvstore.page import LayoutDesc
from kvstore.server.placement.housekeeping import Housekeeper
from kvstore.server.stats import Reporter


class Removals:
    def __init__(self, config: ServerConfig, directory: Directory, keeper: Housekeeper, reporter: Reporter,
                 layouts: dict[bytes, LayoutDesc]) -> None:
        self.config = config
        self.node = config.node
        self.directory = directory
        self.keeper = keeper
        self.residence = keeper.residence
        self.reporter = reporter
        self._layouts = layouts  # the core's: a namespace cleared whole loses its layout binding

    def _of(self, namespace_id: bytes, keys: list[bytes]) -> list[bytes]:
        return [k for k in keys if (e := self.directory.get(k)) is not None and e.namespace_id == namespace_id]

    def publish_remote(self, namespace_id: bytes, records: list[tuple[bytes, str, str, int]],
                       generation: int | None = None) -> list[int]:
        """Records pages held by other nodes (their bytes are durable there), of ``generation``
        when given (StaleGeneration unless the namespace is at it); all or none."""
        for _, node, _, _ in records:
            if node == self.node:
                raise InvalidRequest(f"locations on this node ({node}) are published by its tiers, not by Publish")
        return self.directory.publish_remote(namespace_id, records, self.config.max_remote_records_per_node,
                                             self.config.max_remote_records, generation)

    def withdraw_remote(self, namespace_id: bytes, node: str, keys: list[bytes], tier: str = "") -> int:
        """Drops locations another node recorded here (cluster: it no longer holds them)."""
        if node == self.node:
            raise InvalidRequest(f"locations on this node ({node}) are withdrawn by its tiers, not by Remove")
        return sum(len(self.directory.remove(k, node, tier or None)) for k in self._of(namespace_id, keys))

    def remove(self, namespace_id: bytes, keys: list[bytes], tier: str = "") -> int:
        """Removes pages (only their copies in ``tier`` when given); returns how many keys
        lost a location."""
        mine = self._of(namespace_id, keys)
        self.keeper.delete_lower_first(mine, tier)
        local: list[tuple[bytes, str]] = []
        count = 0
        for key in mine:
            gone = self.directory.remove(key, None, tier or None)
            count += bool(gone)
            local += [(key, loc.tier) for loc in gone if loc.node == self.node]
        with self.keeper.critical():
            for key, name in local:
                index = self.residence.index(name)
                if index is not None:
                    self.residence.drop(key, index)
            self.reporter.refresh_gauges()
        return count

    def enter_generation(self, namespace_id: bytes, generation: int) -> int | None:
        """``enter_generations`` of one namespace: None when it was at ``generation`` already."""
        return self.enter_generations({namespace_id: generation}).get(namespace_id)

    def enter_generations(self, raised: Mapping[bytes, int]) -> dict[bytes, int]:
        """Raises each namespace of ``raised`` to its generation there (the directory's table, all in one
        transaction, synced, first): its entries go, its landing copies now (at their last unpin when leased),
        its lower copies as owed removals, outside the lock. A crash before those finish leaves pages of the
        older generation on disk, which recovery drops. Returns the pages dropped of each namespace raised;
        those at their generation or above already are left out."""
        above = self.directory.persist_generations(raised)
        if not above:
            return {}
        tiers = self.residence.tiers
        with self.keeper.critical():  # commits check the generation under this lock (core.commit)
            removed = self.directory.enter_generations(above)
            for namespace_id, gone in removed.items():
                for key, _ in gone:
                    for index in range(len(tiers)):
                        if self.residence.part(key, index) is not None:
                            self.residence.drop(key, index)
                self._layouts.pop(namespace_id, None)
            self.reporter.refresh_gauges()
        return {namespace_id: len(gone) for namespace_id, gone in removed.items()}
