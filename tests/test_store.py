"""End to end through a real server: long prefixes, eviction and promotion, events,
invalidation, metrics, two worker processes."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
import urllib.request

import grpc
import pytest
import torch
from support.kv import random_kv
from support.servers import make_config

from kvstore import KVLayout, Namespace
from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import InvalidRequest, PageMissing, TierFull


async def test_long_prefix_qwen3_shape_with_partial_last_page(server_factory) -> None:
    """8,192 + 5 tokens of a Qwen3-8B-shaped layout (4 of its 36 layers, to keep CI fast)."""
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_tokens=16)
    ns = Namespace(model="Qwen/Qwen3-8B", revision="test", layout=layout)
    server = server_factory(host_bytes=256 << 20, ssd_bytes=None)
    tokens = list(range(100, 100 + 8192 + 5))
    kv = random_kv(layout, len(tokens), seed=1)
    async with KVStoreClient(server.address, ns) as client:
        assert client.shared_memory
        assert await client.put(tokens, kv) == 8192
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 8192 and hit.num_pages == 512
        assert {loc.tier for loc in hit.locations} == {"host"}
        out = torch.zeros_like(kv)
        assert await client.get(hit, into=out) == 8192
        assert torch.equal(out[:, :, :8192], kv[:, :, :8192])
        assert not out[:, :, 8192:].any(), "nothing beyond the hit may be written"
        # A diverging suffix shares only the common full pages.
        fork = tokens[:1000] + [1] * 500
        assert (await client.lookup(fork)).num_tokens == 992


async def test_lookup_of_8192_pages_is_one_rpc(server_factory) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, page_tokens=16)
    ns = Namespace(model="tiny", revision="r", layout=layout)
    server = server_factory(host_bytes=64 << 20, ssd_bytes=None)
    tokens = list(range(8192 * 16))
    kv = random_kv(layout, len(tokens), seed=2)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv) == len(tokens)
        before = _count(server, "Lookup")
        hit = await client.lookup(tokens)
        assert hit.num_pages == 8192
        assert _count(server, "Lookup") == before + 1


def _count(server, method: str) -> float:
    for metric in server.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "kvstore_rpc_seconds_count" and sample.labels.get("method") == method:
                return sample.value
    return 0.0


async def test_pressure_demotes_to_ssd_and_hits_promote_back(server_factory, layout, ns) -> None:
    server = server_factory(host_bytes=8 << 20, ssd_bytes=64 << 20)  # 8 MiB host: 256 small pages
    tokens = list(range(16 * 400))  # 400 pages of 32 KiB = 12.5 MiB
    kv = random_kv(layout, len(tokens), seed=3)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.lookup(tokens)
        assert hit.num_pages == 400
        tiers = [loc.tier for loc in hit.locations]
        # the host tier keeps the head of the prefix; deeper pages went down (server/placement/chains.py: tail first)
        assert tiers[0] == "host" and "ssd" in tiers
        # The whole hit is larger than the host tier: the client fetches it in batches and
        # each batch promotes its ssd pages, evicting the ones already copied.
        out = torch.empty_like(kv)
        assert await client.get(hit, into=out) == len(tokens)
        assert torch.equal(out, kv)
    stats = server.core.stats()
    assert stats.counters["ssd"]["hits"] > 0 and stats.counters["host"]["evictions"] > 0


async def test_events_invalidate_and_metrics(server, layout, ns) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        stream = stub.Subscribe(directory_pb2.SubscribeRequest(from_seq=1))
        tokens = list(range(64))
        async with KVStoreClient(server.address, ns) as client:
            await client.put(tokens, random_kv(layout, 64))
            seen = []
            async for ev in stream:
                seen.append(ev)
                if len(seen) == 4:
                    break
            assert [e.kind for e in seen] == [directory_pb2.Event.STORED] * 4
            assert [e.seq for e in seen] == [1, 2, 3, 4]
            assert {e.key for e in seen} == set(client.keys(tokens))
            r = await stub.Invalidate(directory_pb2.InvalidateRequest(namespace_id=ns.namespace_id))
            assert r.num_removed == 4
            async for ev in stream:
                assert ev.kind == directory_pb2.Event.CLEARED and ev.namespace_id == ns.namespace_id
                break
            stream.cancel()
            assert (await client.lookup(tokens)).num_tokens == 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()  # noqa: ASYNC210
    for name in ("kvstore_hits_total", "kvstore_misses_total", "kvstore_bytes_in_total", "kvstore_pages",
                 "kvstore_evictions_total", "kvstore_rpc_seconds_bucket"):
        assert name in text, name


async def test_get_after_pages_vanish_raises_with_valid_prefix(server, layout, ns) -> None:
    tokens = list(range(160))
    kv = random_kv(layout, 160)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        hit = await client.lookup(tokens)
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = directory_pb2_grpc.DirectoryStub(channel)
            await stub.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=[hit.keys[6]]))
        out = torch.zeros_like(kv)
        with pytest.raises(PageMissing, match="96 tokens are valid") as err:
            await client.get(hit, into=out)
        assert err.value.num_tokens == 96
        assert torch.equal(out[:, :, :96], kv[:, :, :96])


WORKER = textwrap.dedent(
    """
    import asyncio, sys, torch
    from kvstore import KVLayout, Namespace
    from kvstore.client import KVStoreClient
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
    ns = Namespace(model="demo", revision="r1", layout=layout)
    tokens = list(range(int(sys.argv[3])))
    kv = torch.randn(4, 2, len(tokens), 2, 64, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    async def main(addr, role):
        async with KVStoreClient(addr, ns) as c:
            assert c.shared_memory
            if role == "put":
                print(await c.put(tokens, kv))
            else:
                hit = await c.lookup(tokens)
                out = torch.empty_like(kv[:, :, :hit.num_tokens])
                await c.get(hit, into=out)
                print(hit.num_tokens, torch.equal(out, kv[:, :, :hit.num_tokens]))
    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_two_worker_processes_share_pages(server) -> None:
    def run(role: str) -> str:
        res = subprocess.run([sys.executable, "-c", WORKER, server.address, role, "1000"], check=False, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    assert run("put") == "992"
    assert run("get") == "992 True"


async def test_concurrent_clients_same_pages(server, layout, ns) -> None:
    tokens = list(range(640))
    kv = random_kv(layout, 640, seed=9)

    async def worker(i: int) -> None:
        async with KVStoreClient(server.address, ns) as client:
            assert await client.put(tokens, kv) == 640
            hit = await client.lookup(tokens)
            out = torch.empty_like(kv)
            await client.get(hit, into=out)
            assert torch.equal(out, kv)

    await asyncio.gather(*(worker(i) for i in range(6)))
    assert server.core.view().tiers["host"].num_pages == 40


def test_event_ring_resync() -> None:
    """A subscriber asking for events that fell out of the ring first gets RESYNC."""
    from kvstore.directory import EventKind, EventLog

    log = EventLog(first_seq=1, capacity=4)
    for i in range(10):
        log.append(EventKind.STORED, b"n" * 16, bytes([i]) * 16)
    events = log.since(1)
    assert events[0].kind == EventKind.RESYNC
    assert [e.seq for e in events[1:]] == [7, 8, 9, 10]
    assert [e.seq for e in log.since(9)] == [9, 10]
    assert log.since(11) == []


async def test_subscribers_are_bounded(server_factory) -> None:
    server = server_factory(max_subscribers=1)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        first = stub.Subscribe(directory_pb2.SubscribeRequest())
        await asyncio.sleep(0.3)
        second = stub.Subscribe(directory_pb2.SubscribeRequest())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in second:
                pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many subscribers" in err.value.details()
        first.cancel()
        assert (await stub.Stats(directory_pb2.StatsRequest())).node == "local"


async def test_get_through_a_crowded_host_tier_with_two_acquires_in_flight(server_factory, tmp_path, layout, ns) -> None:
    """The client keeps two acquires in flight; when the host tier cannot take a whole batch
    of promoted pages (here most of it is leased by someone else) answers come back short,
    the acquire issued after a short one is stale and asked again, and a TierFull while our
    own leases hold the space waits for them. The get still delivers every page, in order.
    Only allocations evict (no demoter): a demoter's round, under load, wrote the second
    put's last pages down before the blocker leased them (5 of 20 runs beside 3 CPU burners)."""
    config = make_config(tmp_path, host_bytes=8 << 20, ssd_bytes=64 << 20)  # 256 host slots of 32 KiB
    server = server_factory(dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=1.0, demote_to=1.0)))
    tokens = list(range(16 * 300))
    kv = random_kv(layout, len(tokens), seed=11)
    other = list(range(10**6, 10**6 + 16 * 240))
    answers: list[tuple[int, int]] = []
    async with KVStoreClient(server.address, ns) as client, grpc.aio.insecure_channel(server.address) as channel:
        assert await client.put(tokens, kv) == len(tokens)  # most of it demoted to ssd
        assert await client.put(other, random_kv(layout, len(other), seed=12)) == len(other)
        data = data_pb2_grpc.DataStub(channel)
        blocker = await data.Acquire(data_pb2.AcquireRequest(namespace_id=ns.namespace_id, keys=client.keys(other), ttl_ms=60_000))
        assert len(blocker.pages) == 240  # promotions share the other 16 slots
        hit = await client.lookup(tokens)
        assert hit.num_pages == 300
        acquire = client.transport.acquire
        calls = 0

        async def counted(keys: list[bytes]) -> data_pb2.AcquireResponse:
            nonlocal calls
            calls += 1
            if calls == 3:  # the third acquire: two of ours are in flight or copying (counted by calls:
                answers.append((len(keys), -1))  # answers arrive in any order under load)
                raise TierFull("host tier is full and every page in it is leased")
            answer = await acquire(keys)
            answers.append((len(keys), len(answer.pages)))
            return answer

        client.transport.acquire = counted  # type: ignore[method-assign]
        out = torch.zeros_like(kv)
        assert await client.get(hit, into=out) == len(tokens)
        client.transport.acquire = acquire  # type: ignore[method-assign]
        assert torch.equal(out, kv)
        assert any(0 < got < asked for asked, got in answers), answers
        assert (-1 in [got for _, got in answers]) and calls > 3, f"the get went on after the TierFull: {answers}"
        await data.Release(data_pb2.ReleaseRequest(lease_id=blocker.lease_id))
        # Every lease of the get is gone: the whole tier can be filled again.
        fresh = list(range(2 * 10**6, 2 * 10**6 + 16 * 250))
        assert await client.put(fresh, random_kv(layout, len(fresh), seed=13)) == len(fresh)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_storing_again_a_page_removed_while_leased_leaks_no_slot(server_factory, layout, ns, use_shm: bool) -> None:
    """Bug: a page removed while a reader held it stays in the arena (doomed) until its last
    pin goes. A put of the same key meanwhile was given a new slot and committed it over
    the doomed entry: the old slot was never freed (leaked until restart), and the reader's
    release then freed the new copy, while the directory still listed it on the host tier
    (a lookup promised a page whose bytes were gone)."""
    server = server_factory(ssd_bytes=None)
    tokens = list(range(32))
    kv = random_kv(layout, 32, seed=51)
    async with KVStoreClient(server.address, ns, use_shm=use_shm) as client:
        assert await client.put(tokens, kv) == 32
        keys = client.keys(tokens)
        with grpc.insecure_channel(server.address) as channel:
            data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
            lease = data.Acquire(data_pb2.AcquireRequest(namespace_id=ns.namespace_id, keys=keys, ttl_ms=60_000), timeout=10)
            directory.Remove(directory_pb2.RemoveRequest(namespace_id=ns.namespace_id, keys=keys[1:]), timeout=10)
            stored = await client.put(tokens, kv)  # page 1 again, while the reader still holds its removed copy
            data.Release(data_pb2.ReleaseRequest(lease_id=lease.lease_id), timeout=10)
        usage = server.core.view().tiers["host"]
        assert usage.used_bytes == usage.num_pages * layout.page_bytes, "a slot stays allocated with no page in it"
        hit = await client.lookup(tokens)
        assert hit.num_tokens == stored, "what the put said it stored is what is found"
        out = torch.zeros_like(kv)
        assert await client.get(hit, into=out) == hit.num_tokens, "a page the lookup found must be readable"
        assert torch.equal(out[:, :, : hit.num_tokens], kv[:, :, : hit.num_tokens])


@pytest.mark.parametrize("use_shm", [True, False])
async def test_put_of_less_than_a_page_stores_nothing_and_says_so(server, layout, ns, use_shm) -> None:
    """Bug: ``put`` (documented: stores the full pages, returns the tokens stored) raised
    InvalidRequest 'keys must not be empty' for a prompt shorter than one page, where
    ``lookup`` of the same tokens answers 0: an engine saving every prompt failed on each
    short one. Now it returns 0 (also durable) and leaves nothing allocated."""
    kv = random_kv(layout, layout.page_tokens - 1)
    async with KVStoreClient(server.address, ns, use_shm=use_shm) as client:
        assert await client.put(list(range(layout.page_tokens - 1)), kv) == 0
        assert await client.put([], kv[:, :, :0]) == 0
        assert await client.put(list(range(3)), kv, durable=True) == 0
        save = client.save(list(range(3)), kv)
        for layer in range(layout.num_layers):
            save.layer_done(layer)
        assert await save.finished() == 0
    assert server.core.view().idle


async def test_hint_of_less_than_a_page_or_an_out_of_range_eta_is_answered_not_raised(server, layout, ns) -> None:
    """Bug: ``hint`` raised InvalidRequest 'keys must not be empty' for a queued prompt
    shorter than one page, and a raw ValueError/OverflowError from protobuf (not a
    KVStoreError) for an eta the wire's uint32 milliseconds cannot hold (1e30, inf, NaN).
    A short prompt has nothing to prefetch (False, not sent); such an eta is InvalidRequest
    naming eta_s, like one beyond --max-hint-eta-s is from the server."""
    tokens = list(range(4 * layout.page_tokens))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.hint(list(range(3)), 1.0) is False
        assert await client.hint_batch([(list(range(3)), 1.0), (tokens, 1.0), ([], 2.0)]) == [False, True, False]
        for eta_s in (1e30, float("inf"), float("nan")):
            with pytest.raises(InvalidRequest, match="eta_s"):
                await client.hint(tokens, eta_s)
        assert await client.hint(tokens, -1.0) is True  # already due
