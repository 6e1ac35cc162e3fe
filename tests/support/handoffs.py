"""Helpers of the handoff tests: the server's lease count, and a poll until a condition holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient


async def leases(client: KVStoreClient) -> int:
    """The leases the server holds (Directory.Stats)."""
    return int((await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())).num_leases)


async def until(done: Callable[[], object], what: str, within_s: float = 10.0) -> None:
    """Polls ``done`` until it is true; fails naming ``what`` past ``within_s``."""
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < within_s, what
        await asyncio.sleep(0.02)
