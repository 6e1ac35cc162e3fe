"""Clients copying through the arena while their server is SIGKILLed and restarted: every
Allocate and Acquire answer names the arena its offsets are in, and a client copies only
through the mapping of that arena (ShmTransport.mapping, client/restart.py).

Found by kvstore-bench chaos (seed 10023 of `--seed 10000`): a node restarted under its
clients answered PageCorrupt to reads and puts for seconds, and quarantined pages of its
own: an answer of the new server was copied through the old server's mapping (a false
checksum failure), and an allocation of the old server written through the new mapping
overwrote the new server's pages at the old offsets. Before the fix, this test saw hundreds
of PageCorrupt in one run."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import grpc
import torch
from support.kv import random_kv
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError, PageCorrupt

TOKEN = "tenant-a-token-0123456789abcdef"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_tokens=16)
ROOTS = 40
RESTARTS = 3


def tokens_of(root: int) -> list[int]:
    return list(range(root * 1000, root * 1000 + 4 * LAYOUT.page_tokens))


def kv_of(root: int) -> torch.Tensor:
    return random_kv(LAYOUT, 4 * LAYOUT.page_tokens, seed=root)


class Tally:
    def __init__(self) -> None:
        self.corrupt: list[str] = []
        self.wrong = 0
        self.calls = 0


async def traffic(client: KVStoreClient, seed: int, stop: asyncio.Event, tally: Tally) -> None:
    """Puts and reads of random prefixes until ``stop``; a miss or an UNAVAILABLE while the
    server is down is fine, a PageCorrupt or a wrong byte is not."""
    rng = random.Random(seed)
    while not stop.is_set():
        root = rng.randrange(ROOTS)
        tally.calls += 1
        try:
            if rng.random() < 0.5:
                await client.put(tokens_of(root), kv_of(root), durable=rng.random() < 0.3)
            else:
                hit = await client.lookup(tokens_of(root))
                out = torch.zeros_like(kv_of(root))
                n = await client.get(hit, out) if hit.num_tokens else 0
                tally.wrong += int(not torch.equal(out[:, :, :n], kv_of(root)[:, :, :n]))
        except PageCorrupt as exc:
            tally.corrupt.append(str(exc))
        except KVStoreError:
            pass
        await asyncio.sleep(0.002)


async def num_quarantined(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stats = await directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10,
                                                                      metadata=[("authorization", f"Bearer {TOKEN}")])
        return int(stats.num_quarantined)


async def test_clients_copy_only_through_the_arena_an_answer_names_across_restarts(tmp_path: Path) -> None:
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"tokens": [{"tenant": "a", "rights": ["read", "write"], "token": TOKEN}]}))
    auth.chmod(0o600)
    server = ServerProcess(tmp_path, "--auth-file", str(auth))
    server.start()
    clients = [KVStoreClient(server.address, Namespace("m", f"r{i % 2}", LAYOUT), token=TOKEN, timeout_s=5.0, copy_threads=1)
               for i in range(3)]
    tally, stop = Tally(), asyncio.Event()
    try:
        for client in clients:
            await client.connect()
            assert client.shared_memory
        workers = [asyncio.create_task(traffic(clients[w % 3], w, stop, tally)) for w in range(6)]
        for _ in range(RESTARTS):
            await asyncio.sleep(1.0)
            server.kill()
            await asyncio.sleep(0.2)
            server.start()
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*workers)
        assert tally.calls > 100
        assert not tally.corrupt, f"{len(tally.corrupt)} PageCorrupt across restarts, the first: {tally.corrupt[0]}"
        assert tally.wrong == 0
        assert await num_quarantined(server.address) == 0, "the restarted server found pages of its own overwritten"
        async with KVStoreClient(server.address, Namespace("m", "r0", LAYOUT), token=TOKEN) as fresh:
            for root in range(ROOTS):
                hit = await fresh.lookup(tokens_of(root))
                out = torch.zeros_like(kv_of(root))
                n = await fresh.get(hit, out) if hit.num_tokens else 0
                assert torch.equal(out[:, :, :n], kv_of(root)[:, :, :n])
    finally:
        stop.set()
        for client in clients:
            await client.close()
        server.kill()
