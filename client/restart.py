"""After the server restarted: what a client on its host holds of it, taken again.

More: client/README.md (### restart.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvstore._proto import data_pb2
from kvstore.callsocket.client_aio import AsyncCallChannel
from kvstore.callsocket.client_sync import CallChannel
from kvstore.client.arena import ArenaMap
from kvstore.client.runtime import Runtime
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)


def map_arena(info: Any, bearer: str | None) -> ArenaMap | None:
    """The client's mapping of the arena a GetInfo answer announces, or None (reason logged)."""
    if info.arena_socket:
        return ArenaMap.receive(info.arena_socket, bearer, info.arena_bytes, info.arena_token)
    return ArenaMap.open(info.arena_path, info.arena_bytes, info.arena_token)


class ServerAgain:
    """Learns the server's call socket and call token again (the arena re-mapped when it is
    another one); ``remap`` hands the client the new mapping. Runs on the client's runtime."""

    def __init__(self, runtime: Runtime, bearer: str | None, arena_token: bytes | None,
                 remap: Callable[[ArenaMap], None]) -> None:
        self.runtime = runtime
        self._bearer = bearer
        self._arena_token = arena_token  # of the arena mapped; None: the client maps none
        self._remap = remap
        self._lock: asyncio.Lock | None = None  # made on the runtime loop: one learner at a time

    async def open_channels(self, info: Any, timeout_s: float) -> CallChannel | None:
        """Opens (from the caller's loop) the blocking call channel (None: this host cannot use
        the socket) and, when pages go through the arena, the runtime's async one (``local``)."""
        loop = asyncio.get_running_loop()
        calls = await loop.run_in_executor(None, CallChannel.open, info.call_socket, self._bearer, info.call_token,
                                           timeout_s, self.call_socket_blocking, self.runtime.process.check)
        if self._arena_token is not None:
            self.runtime.local = await self.runtime.call(
                AsyncCallChannel.open(info.call_socket, self._bearer, info.call_token, self.call_socket))
        return calls

    async def call_socket(self) -> tuple[str, bytes] | None:
        """(the server's call socket, its call token) now; None (reason logged) when it cannot
        be asked, offers no socket, or its new arena cannot be mapped (the channel then keeps
        refusing the socket)."""
        try:
            return await self._call_socket()
        except KVStoreError as exc:
            logger.info("the server's call socket not learnt again: %s", exc)
            return None

    async def _call_socket(self) -> tuple[str, bytes] | None:
        info = await self._learn()
        if not info.call_socket or (self._arena_token is not None and info.arena_token != self._arena_token):
            return None  # no socket, or the new arena could not be mapped
        return info.call_socket, bytes(info.call_token)

    async def arena_again(self) -> None:
        """Maps the server's arena now if it is another one: an Allocate or Acquire answer named
        offsets in an arena this client does not map (ShmTransport.mapping). A failure is logged;
        the caller then gives its answer back."""
        try:
            await self._learn()
        except KVStoreError as exc:
            logger.info("the restarted server's arena not mapped: %s", exc)

    async def _learn(self) -> Any:
        """GetInfo, and the arena it announces mapped when it is another one than the client's."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            runtime = self.runtime
            info = await runtime.rpc(runtime.data.GetInfo, data_pb2.GetInfoRequest())
            if self._arena_token is not None and info.arena_token and info.arena_token != self._arena_token:
                arena = await asyncio.get_running_loop().run_in_executor(None, map_arena, info, self._bearer)
                if arena is not None:
                    self._remap(arena)
                    self._arena_token = info.arena_token
                    logger.info("the restarted server's arena is mapped")
            return info

    def call_socket_blocking(self, timeout_s: float) -> tuple[str, bytes] | None:
        """``call_socket`` from a thread of the caller's; None on the runtime's own (it would
        wait for itself: a give-back run from a runtime callback)."""
        if self.runtime.on_loop():
            return None
        try:
            return self.runtime.run(self.call_socket(), timeout_s)
        except RuntimeError:  # the runtime's thread outside its loop
            return None
        except KVStoreError as exc:
            logger.info("the server's call socket not learnt again: %s", exc)
            return None
