"""--advertise-data-port: a node's data listener reached at another port than its own (a NAT, a
port forward; ``kvstore-bench migrate`` puts its capped link there), as --advertise does for gRPC."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from support.cluster_nodes import LAYOUT, NS, Node, eventually, tokens_of
from support.etcd_proc import etcd_fixture, free_port  # noqa: F401  # the fixture
from support.kv import random_kv

from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.client import KVStoreClient


async def test_peers_fetch_a_nodes_pages_through_its_advertised_data_port(tmp_path: Path, etcd) -> None:
    """Node a listens for page fetches on one port and advertises a forwarder's: node c's fetch
    of a's pages (the TCP plane) goes through the forwarder and arrives bit-exact, and etcd's
    member record names the advertised port."""
    data_port = free_port()
    forward = LinkProxy(f"127.0.0.1:{data_port}", math.inf)
    a = Node(tmp_path, "a", etcd.url, "tcp", "--data-port", str(data_port), "--advertise-data-port", str(forward.port))
    c = Node(tmp_path, "c", etcd.url, "tcp")
    tokens = tokens_of(3, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=3)
    try:
        for node in (a, c):
            node.launch()
        for node in (a, c):
            node.wait_ready()
        async with KVStoreClient(a.address, NS) as on_a, KVStoreClient(c.address, NS) as on_c:
            assert await on_a.put(tokens, kv) == len(tokens)

            async def found() -> bool:
                return (await on_c.lookup(tokens)).num_tokens == len(tokens)

            await eventually(found, 5, "a's pages in c's lookup")
            out = torch.zeros_like(kv)
            assert await on_c.get(await on_c.lookup(tokens), out) == len(tokens)
            assert torch.equal(out, kv)
        assert forward.num_bytes >= 8 * LAYOUT.page_bytes
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "kvstore.cli.ctl", "--json", "cluster", "--etcd",
                                                        etcd.url], check=True, capture_output=True, text=True, timeout=60)
        data = {m["node"]: m["data"] for m in json.loads(done.stdout)["members"]}
        assert data["a"] == f"127.0.0.1:{forward.port}" and data["c"] != data["a"]
    finally:
        for node in (a, c):
            if node.proc is not None:
                node.stop()
        forward.close()
