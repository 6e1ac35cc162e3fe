"""The client's one way to make a unary call (DESIGN §8): ``Calls`` picks the call socket or gRPC.

``await calls.unary(name, request)`` from any event loop, ``calls.call`` / ``calls.post`` from a
thread of the caller's. The choice, in one place (``_way``): a method the call socket serves goes
over the socket where this client has one, else (or when the socket did not take the request)
over gRPC, within one deadline. Two socket channels besides the runtime's save a thread hop, kept
because each saves > 0.1 ms a call (client/README.md): a thread's blocking channel (``blocking``),
and, for a Lookup from another loop, a channel of that loop. Errors are the same either way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Awaitable
from typing import Any

from kvstore._proto import data_pb2, directory_pb2
from kvstore.callsocket import frames
from kvstore.callsocket.client_aio import AsyncCallChannel, NotSent
from kvstore.callsocket.client_sync import CallChannel
from kvstore.client.runtime import Runtime
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

NOTHING_GRANTED = frozenset({"Directory.Lookup"})  # an answer nobody reads leaves nothing to give back
MAX_LOOPS = 4  # caller loops with a channel of their own; others go through the runtime
CONNECTIONS_PER_LOOP = 2  # a third concurrent lookup on one loop goes through the runtime (the server allows 32 per pid)


def response_type(name: str) -> Any:
    """The response message class of the unary method ``name`` ("Data.Acquire")."""
    service, method = name.split(".", 1)
    return getattr(directory_pb2 if service == "Directory" else data_pb2, method + "Response")


_NOT_TAKEN = object()  # the call socket did not take the request: the caller goes on another way


async def _over_socket(channel: AsyncCallChannel, address: str, name: str, request: Any,
                       timeout_s: float) -> tuple[Any, float]:
    """``name`` over a call socket channel: its answer and ``timeout_s``, or _NOT_TAKEN and what is
    left of ``timeout_s`` (one deadline for both tries) when the socket did not take the request.
    KVStoreError DEADLINE_EXCEEDED when it took it and did not answer in time."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        return await channel.call(name, request, timeout_s), timeout_s
    except NotSent as exc:
        logger.debug("%s not over the call socket: %s", name, exc)
        return _NOT_TAKEN, max(1e-3, timeout_s - (loop.time() - start))
    except TimeoutError:
        raise KVStoreError(f"kvstore-server at {address}: DEADLINE_EXCEEDED: {name} (call socket, {timeout_s:.3f} s)") from None


class Calls:
    """The unary calls of one client; see the module docstring. Thread-safe."""

    def __init__(self, runtime: Runtime | None, blocking: CallChannel | None = None) -> None:
        """``runtime``: the client's (None: not connected, every call raises KVStoreError);
        ``blocking``: the call socket's channel for threads, when this host can use the socket."""
        self._runtime = runtime
        self.blocking = blocking
        self._channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncCallChannel] = weakref.WeakKeyDictionary()
        # each loop's finalizer, detached by close: it holds the channel, and through it this
        # object and the runtime, for as long as a loop that outlives the client runs
        self._finalizers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.finalize] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._closed = False

    def _connected(self) -> Runtime:
        if self._runtime is None:
            raise KVStoreError("the client is not connected")
        return self._runtime

    async def unary(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        """Calls the unary method ``name`` ("Data.Allocate") from any event loop with a deadline
        (``timeout_s``, by default the client's) and returns its response; a failure raises the
        same KVStoreError whichever way the call went."""
        runtime = self._connected()
        if runtime.on_loop():
            return await self._way(runtime, name, request, timeout_s or runtime.timeout_s)
        runtime.process.check(runtime.address)  # a fork's loop may be a copy of the parent's, its channel too
        timeout_s = timeout_s or runtime.timeout_s
        channel = self._channel() if name in NOTHING_GRANTED else None
        if channel is not None and channel.usable:
            answer, timeout_s = await _over_socket(channel, runtime.address, name, request, timeout_s)
            if answer is not _NOT_TAKEN:
                return answer
        return await runtime.call(self._way(runtime, name, request, timeout_s))

    async def _way(self, runtime: Runtime, name: str, request: Any, timeout_s: float) -> Any:
        """On the runtime loop: over its call socket channel for a method the socket serves
        (no TLS, no per-call token check), else, or when the socket did not take the request,
        over gRPC."""
        local = runtime.local
        if local is not None and name in frames.METHOD_IDS and local.usable:
            answer, timeout_s = await _over_socket(local, runtime.address, name, request, timeout_s)
            if answer is not _NOT_TAKEN:
                return answer
        return await runtime.rpc(runtime.method(name), request, timeout_s)

    def call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        """``unary`` from a thread of the caller's (never the runtime's), blocking it: over the
        blocking channel when this client has one (TimeoutError past ``timeout_s``; what a late
        answer brings is given back), else on the runtime (KVStoreError past ``timeout_s``)."""
        runtime = self._connected()
        timeout_s = timeout_s or runtime.timeout_s
        if self.blocking is not None and name in frames.METHOD_IDS:
            return self.blocking.call(name, request, response_type(name), timeout_s)
        return runtime.run(self._way(runtime, name, request, timeout_s), timeout_s)

    def post(self, name: str, request: Any, timeout_s: float) -> None:
        """Sends a give-back (Release, Abort) whose answer nobody waits for: what it gives back
        expires anyway if it fails. Blocks at most ``timeout_s``; KVStoreError or TimeoutError
        when it was not sent."""
        runtime = self._connected()
        if self.blocking is not None and name in frames.METHOD_IDS:
            self.blocking.post(name, request, timeout_s)
        else:
            runtime.submit(self._way(runtime, name, request, runtime.timeout_s))

    # -- the caller loops' channels --------------------------------------------------------

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
        """Retires every loop's channel (lookups then go through the runtime, which refuses once
        closed) and closes the blocking channel. Call it before the runtime closes."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.items()), weakref.WeakKeyDictionary()
            finalizers, self._finalizers = list(self._finalizers.values()), weakref.WeakKeyDictionary()
        for finalizer in finalizers:
            finalizer.detach()  # retired below
        if self.blocking is not None:
            self.blocking.close()
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
