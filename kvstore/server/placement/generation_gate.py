"""The core's checks of namespace generations and of whether this node may serve (DESIGN §12.4).

An allocation belongs to the namespace's generation when it is made; a commit in another one
is refused (its bytes were computed, or fetched, for a generation that is over). A node that
may not serve reads (cluster mode: not a member caught up with etcd's generations) stores
nothing either. Generations are raised only under the core's lock (removals.py), so a check
made under it holds until the commit publishes.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.directory import Directory
from kvstore.directory.generations import stale_commit_message, stale_message
from kvstore.errors import StaleGeneration, TierUnavailable
from kvstore.server.leases import Allocation
from kvstore.server.placement.removals import Removals


class GenerationGate:
    def __init__(self, directory: Directory, removals: Removals, serving: Callable[[], bool], node: str) -> None:
        self._directory = directory
        self._removals = removals
        self.serving = serving
        self._node = node

    def check_serving(self) -> None:
        """TierUnavailable unless this node may serve: a page it stored now could belong to a
        generation the cluster left meanwhile, dropped once it catches up, after it was acknowledged."""
        if not self.serving():
            raise TierUnavailable(f"node {self._node} is not a member of its cluster now (etcd unreachable, or catching "
                                  "up with it): nothing was stored; store at another node, or once this one has rejoined")

    def require(self, namespace_id: bytes, named: int | None) -> int:
        """The namespace's generation now; StaleGeneration when ``named`` is given and is not it."""
        current = self._directory.generation(namespace_id)
        if named is not None and named != current:
            raise StaleGeneration(stale_message(namespace_id, named, current), current)
        return current

    def check_commit(self, alloc: Allocation) -> None:
        """Core lock held: StaleGeneration when the namespace left the allocation's generation."""
        current = self._directory.generation(alloc.namespace_id)
        if alloc.generation != current:
            raise StaleGeneration(stale_commit_message(alloc.namespace_id, alloc.generation, current), current)

    def read(self, namespace_id: bytes, generation: int) -> None:
        """A node reads pages from here for its ``generation``: a newer one than this node's is
        entered here first (what this node holds of the older is dead); an older one is
        refused (StaleGeneration): its reader would store them under a generation that is over."""
        if generation > self._directory.generation(namespace_id):
            self._removals.enter_generation(namespace_id, generation)
        else:
            self.require(namespace_id, generation)
