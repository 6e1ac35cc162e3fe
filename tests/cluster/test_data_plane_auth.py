"""The UCX data plane of an authenticated cluster serves only the nodes (DESIGN §11-12): a
connection to a node's data port must first present a transfer grant that the node handed
out over its authenticated control plane (gRPC, node right)."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
from pathlib import Path

import torch
from support.certs import CertAuthority
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_auth import A, secure_args
from test_cluster_nodes import LAYOUT, NS, ctl_cluster, tokens_of

from kvstore.client import KVStoreClient
from kvstore.cluster import transport_ucx
from kvstore.security.channel import ClientTLS

NODE_TOKEN = "cluster-node-token-0123456789ab"
RAW_FETCH = Path(__file__).parent / "raw_ucx_fetch.py"


def raw_fetch(address: str, namespace_id: bytes, page_bytes: int, keys: list[bytes], grant: bytes | None = None) -> dict:
    done = subprocess.run([sys.executable, str(RAW_FETCH), address, grant.hex() if grant else "-", namespace_id.hex(), str(page_bytes),
                           *(k.hex() for k in keys)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


async def test_a_client_that_is_not_a_node_gets_no_page_over_ucx(cluster_nodes, etcd, tmp_path: Path, monkeypatch) -> None:
    """Bug: the UCX data plane had no authentication. Whoever reached a node's data port and
    knew a namespace id and page key (a tenant's leaked ids, a sniffed lookup) fetched the
    page, bypassing the tokens, mTLS and tenancy checks of the gRPC plane. Now a connection
    is served only after it presents a one-time grant the node gave another node over
    authenticated gRPC; a raw client gets nothing and the node logs the refusal."""
    ca = CertAuthority(tmp_path / "ca")
    monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", NODE_TOKEN)  # the nodes' processes inherit it
    args = secure_args(tmp_path, ca, ["a", "b"], NODE_TOKEN)
    a, b = cluster_nodes(["a", "b"], "ucx", each=args)
    engine = ca.issue("engine")
    tls = ClientTLS(ca=ca.cert, cert=engine.cert, key=engine.key)
    tokens = tokens_of(11, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=11)
    async with KVStoreClient(a.address, NS, token=A, tls=tls) as a_on_a:
        assert await a_on_a.put(tokens, kv) == len(tokens)
        hit = await a_on_a.lookup(tokens)
    data = {m["node"]: m["data"] for m in ctl_cluster(etcd.url)["members"]}

    got = raw_fetch(data["a"], hit.namespace_id, LAYOUT.page_bytes, hit.keys)
    assert "ok" not in got["statuses"], f"a raw UCX client read tenant a's pages: {got}"
    await eventually(lambda: _logged(a.log, "refused a UCX connection to the data port: no grant"), 10,
                     "node a logging the refused connection")
    got = raw_fetch(data["a"], hit.namespace_id, LAYOUT.page_bytes, hit.keys, grant=secrets.token_bytes(16))  # a forged grant
    assert "ok" not in got["statuses"], f"a forged grant read tenant a's pages: {got}"
    await eventually(lambda: _logged(a.log, "its grant is unknown, used or expired"), 10, "node a logging the forged grant")

    # a connection that presents nothing is dropped after HELLO_TIMEOUT_S, not served nor held
    # forever; and more than MAX_ADMITTING of them at once cannot pile up: a newer one supersedes the oldest
    flood = str(transport_ucx.MAX_ADMITTING + 8)
    done = await asyncio.to_thread(subprocess.run, [sys.executable, str(RAW_FETCH), data["a"], "idle", flood],
                                   capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.strip().endswith("idle"), done.stderr[-3000:]
    await eventually(lambda: _logged(a.log, "no grant within"), 10, "node a dropping the idle connection")
    await eventually(lambda: _logged(a.log, "were still presenting their grant; closed the oldest"), 10,
                     "node a closing the oldest of the flood past its cap")

    # the nodes' own transfers still work: tenant a reads its prefix at b, over UCX, bit-exact
    async with KVStoreClient(b.address, NS, token=A, tls=tls) as a_on_b:
        await eventually(lambda: _found(a_on_b, tokens), 10, "a's prefix in b's lookup")
        out = torch.zeros_like(kv)
        assert await a_on_b.get(await a_on_b.lookup(tokens), out) == len(tokens)
        assert torch.equal(out, kv)
    assert "fetch of" not in b.log.read_text()  # no failed UCX fetch: the grant was taken and accepted


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)


async def _logged(log: Path, text: str) -> bool:
    return text in log.read_text()
