"""Whoever copies through an arena mapping holds it (ArenaMap.hold / drop): a restarted
server's arena replaces the old mapping, which closes only once its last holder let go.

Found by a review of 3158aa2: the transport kept an old mapping open only while a pipelined
copy ran, so a layer-wise load's leased slot views (and a layer-wise save's buffers), and an
arena ``mapping()`` had just handed out, were unmapped under their holders at the next remap:
reading them segfaulted the engine's process."""

from __future__ import annotations

import asyncio
import mmap
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from support.kv import random_kv
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient
from kvstore.client.arena import ArenaMap
from kvstore.client.transport.shm import ShmTransport
from kvstore.errors import KVStoreError

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_tokens=16)


def anonymous_arena(token: bytes) -> ArenaMap:
    return ArenaMap(mmap.mmap(-1, 1 << 20), True, token)


async def nothing() -> None:
    pass


async def test_an_arena_mapping_hands_out_stays_open_until_its_holder_drops_it() -> None:
    shm = ShmTransport(SimpleNamespace(layout=LAYOUT), anonymous_arena(b"old"), copy_threads=1)  # type: ignore[arg-type]
    release = threading.Event()
    other = await shm.mapping(SimpleNamespace(arena_token=b"old"), nothing)  # another request's copy holds it
    running = shm.copy(lambda _: release.wait(5), [0], cpu_rows=False)
    running.add_done_callback(lambda _: other.drop())
    await asyncio.sleep(0.05)
    shm.remap(anonymous_arena(b"new"))  # the restart was learnt meanwhile
    got = await shm.mapping(SimpleNamespace(arena_token=b"old"), nothing)  # an old server's answer, after
    release.set()
    await running
    await asyncio.sleep(0)  # the copy's done callbacks ran
    assert not got.closed, "mapping() handed out an arena closed right after"
    got.slot(0, 4096).fill_(1)  # a layer-wise save's buffer, written
    got.drop()
    assert got.closed, "a retired arena closes with its last holder"
    shm.close()


async def test_a_layerwise_load_reads_its_leased_slots_after_a_remap(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path)
    server.start()
    client = KVStoreClient(server.address, Namespace("m", "r", LAYOUT), timeout_s=5.0)
    try:
        await client.connect()
        assert client.shared_memory
        tokens, kv = list(range(64)), random_kv(LAYOUT, 64, seed=1)
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        staged = client.transport.staged()  # what layerwise/load.py holds for a load
        await client.runtime.call(staged.fill(hit.keys, 5.0))
        assert staged.verify() == 4
        old = client.arena
        server.kill()
        server.start()
        for _ in range(50):  # another request of the client learns the restart and remaps
            try:
                await client.put(list(range(1000, 1064)), kv)
                break
            except KVStoreError:
                await asyncio.sleep(0.1)
        assert client.arena is not old, "the client did not map the restarted server's arena"
        assert not old.closed, "the arena a layer-wise load still reads was closed under it"
        assert staged.verify() == 4
        page = staged.pages[0].clone()  # read as LayerLoad does (unmapped: a segfault)
        assert page.numel() == LAYOUT.page_bytes
        await client.runtime.call(staged.release())
        assert old.closed, "the old arena closes with its last holder"
    finally:
        await client.close()
        server.kill()
