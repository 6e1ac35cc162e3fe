"""Which incarnation (registration epoch) of each other node this shard owner has heard
from, and where in the directory's version order the newest one began.

A node that registers again (a restart, a lost lease) republishes its pages at once, and
that ``Publish`` can reach an owner before the owner's etcd watch says the node registered
again. When the watch then ends the old incarnation, the owner drops the records published
before the newest incarnation's first one, not everything up to the moment it heard: the
fresh records would go too, and nothing would send them again (the page would be a miss
through this owner for as long as it lives). A ``Publish`` or withdrawal of an older
incarnation than one heard is refused: a call of a process that is over, late in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from kvstore.errors import StaleIncarnation

MAX_NODES = 4096  # nodes remembered (node ids are the caller's to name); the oldest heard is forgotten first


class Incarnations:
    def __init__(self, version: Callable[[], int]) -> None:
        self._version = version  # the directory's: the version the last stored location got
        self._lock = threading.Lock()
        self._heard: dict[str, tuple[int, int]] = {}  # node -> (newest epoch, directory version before it began)

    @contextmanager
    def admitting(self, nodes: Iterable[str], epoch: int) -> Iterator[None]:
        """Held while records of ``nodes`` sent by their incarnation ``epoch`` are stored
        (0: the caller did not say; nothing is checked). Raises StaleIncarnation when one of
        them has a newer incarnation already."""
        if not epoch:
            yield
            return
        with self._lock:
            nodes = sorted(set(nodes))
            for node in nodes:
                heard = self._heard.get(node)
                if heard is not None and epoch < heard[0]:
                    raise StaleIncarnation(f"node {node}'s epoch {epoch} is over here (epoch {heard[0]} registered since)")
            for node in nodes:
                self._begin(node, epoch)
            yield

    def ended(self, node: str, epoch: int) -> int:
        """Incarnation ``epoch`` of ``node`` is over (it left or registered again). Returns
        the directory version up to which the node's records go: those stored before a newer
        incarnation's first record, or all stored so far when none was heard yet."""
        with self._lock:
            heard = self._heard.get(node)
            if heard is not None and heard[0] > epoch:
                return heard[1]
            self._begin(node, epoch + 1)  # from now on that incarnation's late calls are refused
            return self._version()

    def _begin(self, node: str, epoch: int) -> None:
        heard = self._heard.get(node)
        if heard is not None and epoch <= heard[0]:
            return
        self._heard.pop(node, None)
        if len(self._heard) >= MAX_NODES:
            del self._heard[next(iter(self._heard))]
        self._heard[node] = (epoch, self._version())
