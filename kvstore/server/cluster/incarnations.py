"""Which incarnation (registration epoch) of each other node this shard owner has heard
from, and where in the directory's version order the newest one began.

More: kvstore/server/cluster/README.md (### incarnations.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kvstore.errors import InvalidRequest, StaleIncarnation

MAX_NODES = 4096  # nodes remembered (node ids are the caller's to name); those the watch lists are forgotten last


class Incarnations:
    def __init__(self, version: Callable[[], int]) -> None:
        self._version = version  # the directory's: the version the last stored location got
        self._lock = threading.Lock()
        self._heard: dict[str, tuple[int, int]] = {}  # node -> (newest epoch, directory version before it began)
        self._watched: dict[str, tuple[int, bool]] = {}  # node -> (epoch the watch last said, listed now)
        self._own: tuple[int, int] = (0, 0)  # (this node's epoch being registered, the directory version then)

    def registering(self, epoch: int) -> None:
        """This node is about to register under ``epoch`` (before etcd has it: whatever the
        others publish once they see it comes after)."""
        with self._lock:
            self._own = (epoch, self._version())

    def own_past(self, epoch: int) -> int | None:
        """The version up to which the other nodes' records go before this node serves under
        ``epoch`` (None: it did not register under it). The same every time: a second catch-up
        (etcd replaced meanwhile) drops again what is already gone, and keeps what came since."""
        with self._lock:
            return self._own[1] if self._own[0] == epoch else None

    @contextmanager
    def admitting(self, nodes: Iterable[str], epoch: int, owner_epoch: int = 0) -> Iterator[None]:
        """Held while records of a node sent by its incarnation ``epoch`` to this node's
        incarnation ``owner_epoch`` are stored (0: the caller did not say; not checked). Raises
        StaleIncarnation when the node has a newer incarnation already, or when this one
        registered again since the sender heard of it; the epoch is noted once they are stored."""
        if not epoch and not owner_epoch:
            yield
            return
        named = set(nodes) if epoch else set()
        if len(named) > 1:
            raise InvalidRequest(f"an epoch is one node's incarnation; the call names {len(named)} nodes")
        with self._lock:  # held while they are stored: a registration's cut (``registering``) is before or after all of them
            if owner_epoch and owner_epoch != self._own[0]:
                raise StaleIncarnation(f"the call is for this node's epoch {owner_epoch}; it registered as epoch "
                                       f"{self._own[0]} since")
            for node in named:
                heard = self._heard.get(node)
                if heard is not None and epoch < heard[0]:
                    raise StaleIncarnation(f"node {node}'s epoch {epoch} is over here (epoch {heard[0]} registered since)")
            before = self._version()
            yield
            for node in named:
                self._begin(node, epoch, before)

    def watched(self, epochs: Mapping[str, int]) -> list[tuple[str, int]]:
        """The watch's members now (node -> epoch, this node left out). Returns (node, version)
        for each node whose incarnations the change ended: its records stored up to that
        version go. A node the watch lists for the first time ends nothing."""
        with self._lock:
            drops = []
            for node, (epoch, listed) in list(self._watched.items()):
                if listed and node not in epochs:  # it left: its incarnation is over
                    self._watched[node] = (epoch, False)
                    drops.append((node, self._superseded(node, epoch + 1)))
            for node, epoch in epochs.items():
                seen = self._watched.pop(node, None)
                self._watched[node] = (epoch, True)
                if seen is None or seen[0] == epoch:
                    continue
                heard = self._heard.get(node)
                if epoch < seen[0] and heard is not None and heard[0] > epoch:  # registered anew in a replaced etcd
                    del self._heard[node]  # (what its new incarnation sent already, heard[0] == epoch, stays)
                drops.append((node, self._superseded(node, epoch)))
            self._forget_over(self._watched, lambda node: not self._watched[node][1])
            return drops

    def _superseded(self, node: str, epoch: int) -> int:
        """Every incarnation of ``node`` before ``epoch`` is over: the version its records go
        up to (those stored before the newest heard incarnation began, or all stored so far)."""
        heard = self._heard.get(node)
        if heard is not None and heard[0] >= epoch:
            return heard[1]
        now = self._version()
        self._begin(node, epoch, now)  # from now on the older incarnations' late calls are refused
        return now

    def _begin(self, node: str, epoch: int, before: int) -> None:
        heard = self._heard.get(node)
        if heard is not None and epoch <= heard[0]:
            return
        self._heard.pop(node, None)
        self._heard[node] = (epoch, before)
        self._forget_over(self._heard, lambda other: not self._watched.get(other, (0, False))[1])

    @staticmethod
    def _forget_over(table: dict[str, Any], unlisted: Callable[[str], bool]) -> None:
        """Past MAX_NODES, the oldest entry of a node the watch does not list goes (else the oldest)."""
        while len(table) > MAX_NODES:
            del table[next((node for node in table if unlisted(node)), next(iter(table)))]
