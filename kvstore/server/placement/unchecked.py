"""Copies this node landed from another node without hashing them (DESIGN §4: one hash, where the
bytes are consumed), each with the node it came from. When a reader finds one damaged and drops
it (a client's copy, the gRPC send, the demoter's check: ``Mover.quarantine_landing``), the node
it came from is asked to check its own copy, as ``Reader.check_below`` checks the tiers below: the
damage is then quarantined where it is, not fetched again by the next reader."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from kvstore.page import PageHeader

logger = logging.getLogger(__name__)

MAX_REMEMBERED = 65_536  # keys; the oldest are forgotten (their source is then not asked)
SourceCheck = Callable[[PageHeader, str], bool]  # (the damaged copy's header, its source node) -> still listening


class UncheckedCopies:
    def __init__(self, capacity: int = MAX_REMEMBERED) -> None:
        self._capacity = capacity
        self._sources: OrderedDict[bytes, tuple[bytes, str]] = OrderedDict()  # key -> (namespace id, source node)
        self._listeners: list[SourceCheck] = []
        self._lock = threading.Lock()

    def landed(self, namespace_id: bytes, keys: list[bytes], source: str) -> None:
        with self._lock:
            for key in keys:
                self._sources[key] = (namespace_id, source)
                self._sources.move_to_end(key)
            while len(self._sources) > self._capacity:
                self._sources.popitem(last=False)

    def forget(self, keys: list[bytes]) -> None:
        """A copy of each of ``keys`` is being stored here: not (yet) one another node sent unchecked.
        Every commit calls it: with nothing noted (a node that fetched nothing unhashed) it takes no lock."""
        if not self._sources:
            return
        with self._lock:
            for key in keys:
                self._sources.pop(key, None)

    def noted(self, key: bytes) -> bool:
        """Whether the copy of ``key`` here landed unhashed from another node (as far as remembered)."""
        return key in self._sources

    def on_damaged(self, check: SourceCheck) -> None:
        """``check`` is called (on the reader's thread) for each damaged copy that came from a
        node; it returns False once it can no longer act (its loop closed): it is dropped."""
        with self._lock:
            self._listeners.append(check)

    def off_damaged(self, check: SourceCheck) -> None:
        """``check`` is called no more (its node left: a later join registers a new one)."""
        with self._lock:
            if check in self._listeners:
                self._listeners.remove(check)

    def damaged(self, header: PageHeader) -> None:
        """The landed copy of ``header.key`` failed a reader's check and was dropped here."""
        with self._lock:
            found = self._sources.pop(header.key, None)
            listeners = list(self._listeners)
        if found is None or found[0] != header.namespace_id:
            return
        for check in listeners:
            if not check(header, found[1]):
                with self._lock:
                    if check in self._listeners:
                        self._listeners.remove(check)

    def __len__(self) -> int:
        return len(self._sources)
