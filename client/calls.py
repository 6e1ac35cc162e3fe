"""Lookups on the caller's own event loop, over the call socket (DESIGN §8).

A lookup through the I/O runtime hops threads twice (the caller's loop to the runtime's and
back): on a loaded 2-core host that was ~0.35 ms of a 512-page lookup whose socket round trip
is ~0.3 ms. A Lookup grants nothing (no lease, no allocation), so nothing has to outlive its
caller: it can run on the caller's loop itself. ``LoopCalls`` keeps one ``AsyncCallChannel``
per caller loop, a sibling of the runtime's (same socket, bearer token, call token; a
restarted server is learnt through the runtime's), opened on that loop's first lookup.

Same guarantees as ``Runtime.unary``: one deadline per call (past it KVStoreError
DEADLINE_EXCEEDED), a caller cancelled mid-call leaves its connection closed (nothing to give
back), and a call the socket did not take (NotSent: socket gone, refused, this loop's
connections busy) goes through the runtime (its call socket, else gRPC) within what is left of
the deadline. Only for methods in ``NOTHING_GRANTED``; everything else keeps the runtime.

Thread-safe: each loop touches only its own channel; ``close`` retires every channel on its
own loop (or at once when that loop runs no more).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Awaitable
from typing import Any

from kvstore.callsocket.client_aio import AsyncCallChannel, NotSent
from kvstore.client.runtime import Runtime
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

NOTHING_GRANTED = frozenset({"Directory.Lookup"})  # an answer nobody reads leaves nothing to give back
MAX_LOOPS = 4  # caller loops with a channel of their own; others go through the runtime
CONNECTIONS_PER_LOOP = 2  # a third concurrent lookup on one loop goes through the runtime (the server allows 32 per pid)


class LoopCalls:
    """The per-caller-loop call channels of one client; see the module docstring."""

    def __init__(self, runtime: Runtime | None) -> None:
        """``runtime``: the client's (None: not connected, every call raises KVStoreError)."""
        self._runtime = runtime
        self._channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncCallChannel] = weakref.WeakKeyDictionary()
        # each loop's finalizer, detached by close: it holds the channel, and through it this
        # object and the runtime, for as long as a loop that outlives the client runs
        self._finalizers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.finalize] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._closed = False

    async def unary(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        """``Runtime.unary`` for a method of NOTHING_GRANTED, called from any event loop."""
        assert name in NOTHING_GRANTED, f"{name} grants what a cancelled caller must give back: call it on the runtime"
        runtime = self._runtime
        if runtime is None:
            raise KVStoreError("the client is not connected")
        runtime.process.check(runtime.address)  # a fork's loop may be a copy of the parent's, its channel too
        if runtime.on_loop():
            return await runtime.unary(name, request, timeout_s)
        timeout_s = timeout_s or runtime.timeout_s
        channel = self._channel()
        if channel is not None and channel.usable:
            loop = asyncio.get_running_loop()
            start = loop.time()
            try:
                return await channel.call(name, request, timeout_s)
            except NotSent as exc:
                logger.debug("%s through the runtime: %s", name, exc)
                timeout_s = max(1e-3, timeout_s - (loop.time() - start))  # one deadline for both tries
            except TimeoutError:
                raise KVStoreError(f"kvstore-server at {runtime.address}: DEADLINE_EXCEEDED: {name} "
                                   f"(call socket, {timeout_s:.3f} s)") from None
        return await runtime.call(runtime.unary(name, request, timeout_s))

    def _channel(self) -> AsyncCallChannel | None:
        """This loop's channel (made on its first call); None without a call socket, once
        closed, or past MAX_LOOPS (closed loops not counted)."""
        local = self._runtime.local if self._runtime is not None else None
        if local is None:
            return None
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                return None
            channel = self._channels.get(loop)
            if channel is None:
                self._forget_closed_loops()
            if channel is None and len(self._channels) < MAX_LOOPS:
                channel = self._channels[loop] = local.sibling(self._hop, CONNECTIONS_PER_LOOP)
                self._finalizers[loop] = weakref.finalize(loop, channel.retire)  # a loop dropped without close: its connections go with it
        return channel

    def _forget_closed_loops(self) -> None:
        """Retires the channels of loops closed but not yet collected (lock held): such a loop
        runs nothing again, and it held one of the MAX_LOOPS places and its connections open."""
        for loop in [loop for loop in list(self._channels) if loop.is_closed()]:
            self._channels.pop(loop).retire()
            finalizer = self._finalizers.pop(loop, None)
            if finalizer is not None:
                finalizer.detach()

    async def _hop(self, awaitable: Awaitable[Any]) -> Any:
        """Awaits one of the runtime channel's coroutines (a relearn) on the runtime loop;
        None once the client is closed."""
        assert self._runtime is not None, "a channel is made only once connected"
        try:
            return await self._runtime.call(awaitable)  # type: ignore[arg-type]
        except KVStoreError as exc:
            logger.info("the server's call socket not learnt again: %s", exc)
            return None

    def close(self) -> None:
        """Retires every loop's channel: lookups go through the runtime (which refuses once closed)."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.items()), weakref.WeakKeyDictionary()
            finalizers, self._finalizers = list(self._finalizers.values()), weakref.WeakKeyDictionary()
        for finalizer in finalizers:
            finalizer.detach()  # retired below
        if self._runtime is not None and self._runtime.process.forked:
            return  # retiring would take the parent's sockets out of the epoll set it shares with this child
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for loop, channel in channels:
            if loop is here or loop.is_closed() or not loop.is_running():
                channel.retire()
                continue
            try:
                loop.call_soon_threadsafe(channel.retire)
            except RuntimeError:  # closed meanwhile: it runs nothing any more
                channel.retire()
