"""A remap (the server restarted, client/restart.py) while a put's copies are queued: the
copies write where the allocation's server said, in the arena mapped when it answered."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from support.kv import random_kv
from support.servers import make_config

from kvstore import KVLayout, Namespace
from kvstore._proto import data_pb2
from kvstore.client import KVStoreClient
from kvstore.client.restart import map_arena
from kvstore.client.transport import ShmTransport


async def test_a_copy_queued_before_a_remap_writes_into_the_arena_its_allocation_named(
        server_factory: Any, tmp_path: Path, ns: Namespace, layout: KVLayout) -> None:
    """Bug: write_slot read ``self.arena`` when the copy thread ran, so a remap between the
    Allocate's answer and the copy sent the bytes to the new server's arena at the old one's
    offsets (someone else's slot there) and committed the old server's slots unwritten."""
    first = server_factory(make_config(tmp_path / "a"))
    other = server_factory(make_config(tmp_path / "b"))
    tokens = torch.arange(4 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(first.address, ns) as client, KVStoreClient(other.address, ns) as stranger:
        shm = client.transport
        assert isinstance(shm, ShmTransport)
        assert stranger.calls.blocking is not None
        info = stranger.calls.blocking.call("Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse)
        arena = map_arena(info, None)
        assert arena is not None
        copy = shm.copy

        def remapped_first(fn: Any, items: list[Any], cpu_rows: bool) -> Any:
            shm.copy = copy  # type: ignore[method-assign]

            first = threading.Lock()  # taken once: the copy threads race for it

            def run(item: Any) -> Any:
                if first.acquire(blocking=False):
                    shm.remap(arena)  # as ServerAgain does, with this copy counted as running
                return fn(item)
            return copy(run, items, cpu_rows)

        shm.copy = remapped_first  # type: ignore[method-assign]
        assert await client.put(tokens, kv) == len(tokens)
    async with KVStoreClient(first.address, ns) as reader:
        out = torch.zeros_like(kv)
        assert await reader.get(await reader.lookup(tokens), out) == len(tokens)
        assert torch.equal(out, kv), "the put's pages hold what was put"
