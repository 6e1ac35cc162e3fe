"""Invalidation with tenants in cluster mode (DESIGN §12.4, found by kvstore-bench chaos): a tenant
invalidates its namespace at any node, also one where it never wrote (where the namespace is
bound to nobody: before, that answered as for an empty namespace, a silent no-op the caller
took for an invalidation); a namespace bound there to another tenant stays as for an empty one."""

from __future__ import annotations

import pytest
from invalidation_cases import served, tokens_owned_by
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_auth import A, B, secure_args
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError

NODE_TOKEN = "cluster-node-token-0123456789ab"


async def test_a_tenant_invalidates_its_namespace_at_a_node_where_it_never_wrote(cluster_nodes, tmp_path, monkeypatch) -> None:
    from support.certs import CertAuthority

    monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", NODE_TOKEN)
    args = secure_args(tmp_path, CertAuthority(tmp_path / "ca"), ["a", "b"], NODE_TOKEN)
    a, b = cluster_nodes(["a", "b"], "grpc", each={n: args[n][:2] for n in ("a", "b")})  # --auth-file only: loopback, tokens
    tokens = tokens_owned_by(["a", "b"], {"a"}, 4)  # every record at a: b never hears of the namespace
    kv = random_kv(LAYOUT, len(tokens), seed=31)
    async with KVStoreClient(a.address, NS, token=A) as on_a, KVStoreClient(b.address, NS, token=A) as on_b, \
            KVStoreClient(b.address, NS, token=B) as other:
        assert await on_a.put(tokens, kv) == len(tokens)
        generation = await on_b.invalidate()  # the namespace is bound to nobody at b
        assert generation == 1
        for node in (a, b):
            assert await served(node.address, tokens, token=A) == 0, f"{node.name} served an invalidated prefix"
        assert await other.invalidate() == 1  # tenant b's own namespace (another salt): a's stays at 1 (the put below)
        assert await on_a.put(tokens, kv, generation=1) == len(tokens)
        with pytest.raises(KVStoreError):
            await on_a.put(tokens_of(32, 1), random_kv(LAYOUT, LAYOUT.page_tokens, seed=32), generation=0)
