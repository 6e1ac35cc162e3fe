"""Server defects found by `kvstore-bench fuzz`, each pinned by the request that found it."""

from __future__ import annotations

import asyncio
import time

import grpc
from support.kv import random_kv
from support.servers import ServerProcess

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.client import KVStoreClient


async def test_remove_with_a_key_twice_removes_it_once(server, layout, ns) -> None:
    """Bug (fuzz: 'reorder+duplicate RemoveRequest.keys'): Remove naming a page on SSD twice
    answered INTERNAL (KeyError): the SSD tier's batch delete popped the key twice, after
    its index transaction had deleted every key of the batch, so the pages after the
    duplicate stayed in the tier's map (and their slots allocated) with no index entry, and
    the directory still listed them. Now: OK, both pages gone, the SSD tier empty."""
    tokens = list(range(32))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, 32), durable=True) == 32
        keys = client.keys(tokens)
    with grpc.insecure_channel(server.address) as channel:
        directory = directory_pb2_grpc.DirectoryStub(channel)
        removed = directory.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=[keys[0], keys[0], keys[1]]),
                                   timeout=10)
        assert removed.num_removed == 2
        assert directory.Lookup(directory_pb2.LookupRequest(namespace_id=ns.namespace_id, keys=keys[1:]), timeout=10).num_pages == 0
        ssd = {t.tier: t for t in directory.Stats(directory_pb2.StatsRequest(), timeout=10).tiers}["ssd"]
        assert (ssd.num_pages, ssd.used_bytes) == (0, 0), "every SSD slot of the removed pages is free"


def _anon_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


async def test_refused_large_requests_do_not_pin_server_memory(tmp_path) -> None:
    """Defect (fuzz: server RSS grew 19-38% over 10,000-30,000 calls and never came back; the
    same run with MALLOC_ARENA_MAX=1 grew 0%): the server keeps the high-water mark of every
    malloc arena. A request was parsed whole (up to the 256 MiB message limit, ~46 B of upb
    per repeated key) and its keys copied into a Python list (~69 B each) before their count
    was checked, in up to 8 untrimmed arenas per core. Eight concurrent 17 MiB Lookups with
    1M keys each, all refused, took the server from ~36 MiB to 490-730 MiB of heap, kept
    after the calls. Now each method refuses a request larger than its largest valid one before
    parsing it (INVALID_ARGUMENT), gRPC refuses one over every method's bound unread
    (RESOURCE_EXHAUSTED), the server's malloc keeps at most 2 arenas, and the heap trimmer
    gives their free pages back every --heap-trim-s. The peak while requests are in flight
    depends on how many overlap (CI under load saw +171 MiB where a quiet run sees +60-100), and
    a trim returns only whole free pages (12 batches of these rounds left +30 to +80 MiB after
    trims, not growing), so the bound is on what stays once the trimmer has run: less than the
    8 concurrent requests x gRPC's 8 MiB receive limit x 2 copies (gRPC's and Python's) = 128 MiB,
    where the defect kept 455-730 MiB."""
    server = ServerProcess(tmp_path, "--heap-trim-s", "0.5")
    server.start()
    try:
        small = (7 << 20) // 18  # a 7 MiB LookupRequest: under gRPC's limit, over Lookup's (65,536 keys allowed)
        big = (17 << 20) // 18  # a 17 MiB one: over every method's
        rounds = [(small, grpc.StatusCode.INVALID_ARGUMENT), (big, grpc.StatusCode.RESOURCE_EXHAUSTED)] * 4
        async with grpc.aio.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            lookup = ch.unary_unary("/kvstore.v1.Directory/Lookup")
            await lookup(b"\x0a\x10" + b"n" * 16 + b"\x12\x10" + b"k" * 16, timeout=30)  # one small call: the server is warm
            rss = [_anon_rss(server.proc.pid)]
            for keys, code in rounds:
                raw = b"\x0a\x10" + b"n" * 16 + (b"\x12\x10" + b"k" * 16) * keys
                results = await asyncio.gather(*(lookup(raw, timeout=120) for _ in range(8)), return_exceptions=True)
                assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == code for r in results), results
                rss.append(_anon_rss(server.proc.pid))
            deadline = time.monotonic() + 30  # 60 trim periods: a loaded CI box still runs one
            while _anon_rss(server.proc.pid) - rss[0] >= 128 << 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            rss.append(_anon_rss(server.proc.pid))
            answer = await lookup(b"\x0a\x10" + b"n" * 16 + b"\x12\x10" + b"k" * 16, timeout=30)
            assert directory_pb2.LookupResponse.FromString(answer).num_pages == 0  # still serving: a miss, answered
        assert rss[-1] - rss[0] < 128 << 20, f"the server kept {[r >> 20 for r in rss]} MiB after refusing requests"
    finally:
        server.proc.kill()
        server.proc.wait(KILL_WAIT_S)
        server.close_pipes()
