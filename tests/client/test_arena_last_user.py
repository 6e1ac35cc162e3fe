"""A client's arena mapping closes with its last user (client/arena.py, ShmTransport.close): a
holder that comes as the mapping is closing either keeps it mapped until its own drop or is
refused (``hold`` False), never handed a mapping unmapped under it.

Found by a review of fb39ddb (ShmTransport.close retires its arenas): ``retire`` and ``drop``
decided to close under the mapping's lock but marked it closed only after letting the lock go,
so a ``hold`` in between (the vLLM worker's copy of a leased load through ``client.arena``, on
its step thread, while the connection closes the client on another) was granted, and the
mapping was unmapped under it."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Self

import pytest

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient


class PausingLock:
    """The mapping's lock; the thread named ``pauses`` stops right after its first release."""

    def __init__(self, pauses: str) -> None:
        self._lock = threading.Lock()
        self.pauses = pauses
        self.paused, self.go = threading.Event(), threading.Event()

    def __enter__(self) -> Self:
        self._lock.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._lock.release()
        if threading.current_thread().name == self.pauses and not self.paused.is_set():
            self.paused.set()
            self.go.wait(5)


@pytest.mark.parametrize("last", ["close", "drop"])
async def test_a_hold_as_the_mapping_closes_is_refused_or_kept_mapped(server, ns: Namespace, layout: KVLayout,
                                                                      last: str) -> None:
    """``close``: the client's transport closes (retire) with nobody holding the arena; ``drop``:
    a receive's lease held it across the close and lets go now. Meanwhile another thread holds it."""
    async with KVStoreClient(server.address, ns) as client:
        arena, transport = client.arena, client.transport
        assert client.shared_memory and arena is not None
        if last == "drop":
            assert arena.hold()  # a handoff receive's Taken
            transport.close()  # type: ignore[attr-defined]
            assert not arena.closed, "retired, still held"
        lock = PausingLock("closing")
        arena._use_lock = lock  # type: ignore[assignment]
        closing = threading.Thread(target=transport.close if last == "close" else arena.drop, name="closing")  # type: ignore[attr-defined]
        closing.start()
        assert lock.paused.wait(5)
        held = arena.hold()  # what the worker's leased copy does with client.arena
        lock.go.set()
        closing.join(5)
        if held:
            assert not arena.closed, "the mapping was unmapped under a holder it had just granted"
            arena.drop()
        assert arena.closed, "closed with its last user"
