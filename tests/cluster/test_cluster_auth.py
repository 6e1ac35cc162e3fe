"""Cluster mode with authentication (DESIGN §11: "node-to-node traffic is mTLS, and a node is a
caller like any other"): three nodes with --auth-file and mTLS, each presenting its own
certificate to the others, which the auth file grants the node right (and nothing else).
Tenants call with tokens. A tenant's prefix stored at one node is found and read at another;
another tenant finds nothing of it anywhere, and no tenant may make the node-only calls."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import torch
from support.certs import CertAuthority
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import data_pb2, directory_pb2
from kvstore.client import KVStoreClient
from kvstore.errors import PermissionDenied
from kvstore.security.channel import ClientTLS

A = "tenant-a-token-0123456789abcdef"
B = "tenant-b-token-0123456789abcdef"


def secure_args(tmp: Path, ca: CertAuthority, names: list[str], node_token: str | None = None) -> dict[str, list[str]]:
    """Per node: the flags of an mTLS server whose certificate is also its identity as a caller
    (CN node-<name>, SAN kvstore-node: one auth-file entry for every node), or, given
    ``node_token``, whose $KVSTORE_CLUSTER_TOKEN is. Every node gets the same tenant salts (a
    tenant's namespace ids are the same at every node)."""
    auth = tmp / "auth.json"
    tenants = [{"tenant": "a", "rights": ["read", "write"], "token": A}, {"tenant": "b", "rights": ["read", "write"], "token": B}]
    if node_token is None:
        doc = {"tokens": tenants, "certs": [{"subject": "kvstore-node", "tenant": "cluster", "rights": ["node"]}]}
    else:
        doc = {"tokens": [*tenants, {"tenant": "cluster", "rights": ["node"], "token": node_token}]}
    auth.write_text(json.dumps(doc))
    auth.chmod(0o600)
    salts = json.dumps({"version": 1, "salts": {t: secrets.token_bytes(16).hex() for t in ("a", "b", "cluster")}})
    args = {}
    for name in names:
        data = tmp / name / "data"
        data.mkdir(parents=True, mode=0o700)
        (data / "tenant-salts.json").write_text(salts)
        (data / "tenant-salts.json").chmod(0o600)
        cert = ca.issue(f"node-{name}", dns=("kvstore-node",), ips=("127.0.0.1",), server=True, client=True)
        args[name] = ["--auth-file", str(auth), "--tls-cert", str(cert.cert), "--tls-key", str(cert.key),
                      "--tls-client-ca", str(ca.cert)]
    return args


@pytest.mark.parametrize(("data_plane", "node_identity"), [("grpc", "cert"), ("ucx", "cert"), ("tcp", "cert"), ("grpc", "token")])
async def test_tenants_across_nodes_with_mtls_between_nodes(cluster_nodes, tmp_path: Path, monkeypatch, data_plane: str,
                                                             node_identity: str) -> None:
    ca = CertAuthority(tmp_path / "ca")
    node_token = None
    if node_identity == "token":
        node_token = "cluster-node-token-0123456789ab"
        monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", node_token)  # the nodes' processes inherit it
    args = secure_args(tmp_path, ca, ["a", "b", "c"], node_token)
    a, b, c = cluster_nodes(["a", "b", "c"], data_plane, each=args)
    engine = ca.issue("engine")  # a client certificate (mTLS); the token names the tenant
    tls = ClientTLS(ca=ca.cert, cert=engine.cert, key=engine.key)
    tokens = tokens_of(7, 24)
    kv = random_kv(LAYOUT, len(tokens), seed=7)
    async with KVStoreClient(a.address, NS, token=A, tls=tls) as a_on_a, KVStoreClient(c.address, NS, token=A, tls=tls) as a_on_c:
        assert a_on_a.namespace.namespace_id == a_on_c.namespace.namespace_id  # the same salt at every node
        assert await a_on_a.put(tokens, kv) == len(tokens)
        await eventually(lambda: _found(a_on_c, tokens, len(tokens)), 10, "a's prefix in c's lookup for tenant a")
        hit = await a_on_c.lookup(tokens)
        assert {r.node for r in hit.runs} == {"a"}
        ns, keys = hit.namespace_id, hit.keys
        # tenant b, at every node, with a's namespace id and keys (leaked): nothing, and nothing pinned
        for node in (a, b, c):
            async with KVStoreClient(node.address, NS, token=B, tls=tls) as b_client:
                assert (await b_client.lookup(tokens)).num_tokens == 0  # its own namespace id differs (salt)
                lookup = await b_client._call(b_client.runtime.directory.Lookup, directory_pb2.LookupRequest(namespace_id=ns, keys=keys))
                assert lookup.num_pages == 0
                acquired = await b_client._call(b_client.runtime.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys))
                assert list(acquired.pages) == []
                for request in (directory_pb2.LookupRequest(namespace_id=ns, keys=keys, local_only=True),
                                directory_pb2.LookupRequest(namespace_id=ns, keys=keys, local_only=True, tenant="a")):
                    with pytest.raises(PermissionDenied):
                        await b_client._call(b_client.runtime.directory.Lookup, request)
        out = torch.zeros_like(kv)
        assert await a_on_c.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)
        hit = await a_on_c.lookup(tokens)  # c holds its own copy now, for tenant a
        assert {r.node for r in hit.runs} == {"c"}
        async with KVStoreClient(c.address, NS, token=B, tls=tls) as b_on_c:
            acquired = await b_on_c._call(b_on_c.runtime.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys))
            assert list(acquired.pages) == []
        # tenant a may not make the node-only calls either, at any node
        for client in (a_on_a, a_on_c):
            record = directory_pb2.PageRecord(key=keys[0])
            record.location.node, record.location.tier = "x", "host"
            with pytest.raises(PermissionDenied):
                await client._call(client.runtime.directory.Publish, directory_pb2.PublishRequest(namespace_id=ns, records=[record]))


async def _found(client: KVStoreClient, tokens: list[int], num_tokens: int) -> bool:
    return (await client.lookup(tokens)).num_tokens == num_tokens
