"""Tenant salts in cluster mode come from etcd, shared by every node (DESIGN §11-12)."""

from __future__ import annotations

import json
import logging
import stat
import threading
from pathlib import Path

import torch
from support.certs import CertAuthority
from support.cluster_nodes import cluster_nodes_fixture, eventually  # noqa: F401  # the fixture
from support.etcd_proc import EtcdProcess, etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_auth import A, B, secure_args
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import data_pb2, directory_pb2
from kvstore.client import KVStoreClient
from kvstore.cluster.salt_records import EtcdSalts
from kvstore.security.channel import ClientTLS
from kvstore.security.salts import FILE_NAME

NODE_TOKEN = "cluster-node-token-0123456789ab"


async def test_a_tenants_prefix_is_read_across_nodes_without_a_copied_salt_file(cluster_nodes, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """Bug: tenant salts were per node (each node's DATA_DIR/tenant-salts.json), so without a
    file copied by the operator a tenant's namespace ids differed per node and its prefix
    stored at one node was never found at another. Now cluster nodes share the salts through
    etcd; tenant b still finds nothing of a's, at any node."""
    ca = CertAuthority(tmp_path / "ca")
    monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", NODE_TOKEN)
    args = secure_args(tmp_path, ca, ["a", "b", "c"], NODE_TOKEN)
    for name in ("a", "b", "c"):
        (tmp_path / name / "data" / FILE_NAME).unlink()  # no salt file copied by an operator
    nodes = cluster_nodes(["a", "b", "c"], "ucx", *args["a"])  # every node's certificate is valid for each (CN aside)
    a, _, c = nodes
    engine = ca.issue("engine")
    tls = ClientTLS(ca=ca.cert, cert=engine.cert, key=engine.key)
    tokens = tokens_of(13, 16)
    kv = random_kv(LAYOUT, len(tokens), seed=13)
    async with KVStoreClient(a.address, NS, token=A, tls=tls) as a_on_a, KVStoreClient(c.address, NS, token=A, tls=tls) as a_on_c:
        assert a_on_a.namespace.namespace_id == a_on_c.namespace.namespace_id, "tenant a's salt differs between nodes"
        assert await a_on_a.put(tokens, kv) == len(tokens)
        await eventually(lambda: _found(a_on_c, tokens), 10, "a's prefix in c's lookup")
        hit = await a_on_c.lookup(tokens)
        out = torch.zeros_like(kv)
        assert await a_on_c.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)
        ns, keys = hit.namespace_id, hit.keys
    for node in nodes:
        async with KVStoreClient(node.address, NS, token=B, tls=tls) as b_client:
            assert b_client.namespace.namespace_id != ns
            assert (await b_client.lookup(tokens)).num_tokens == 0
            lookup = await b_client._call(b_client.runtime.directory.Lookup, directory_pb2.LookupRequest(namespace_id=ns, keys=keys))
            assert lookup.num_pages == 0
            acquired = await b_client._call(b_client.runtime.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys))
            assert list(acquired.pages) == []
    copies = [json.loads((tmp_path / name / "data" / FILE_NAME).read_text())["salts"] for name in ("a", "b", "c")]
    assert copies[0] == copies[1] == copies[2]  # each node's durable copy of the cluster's salts


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)


def test_nodes_racing_to_create_a_tenants_salt_end_with_one(etcd, tmp_path: Path) -> None:
    """Two nodes meeting the same new tenants at once each propose a salt; the etcd
    transaction (create only while absent) makes them agree on one per tenant."""
    tenants = [f"t{i}" for i in range(20)]
    nodes = [EtcdSalts(tmp_path / f"n{i}", [etcd.endpoint], "race") for i in range(2)]
    start = threading.Barrier(len(nodes))
    got: list[dict[str, bytes]] = [{} for _ in nodes]

    def meet(i: int) -> None:
        start.wait()
        for tenant in tenants:
            got[i][tenant] = nodes[i].salt(tenant)

    threads = [threading.Thread(target=meet, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got[0] == got[1] and len(set(got[0].values())) == len(tenants)
    late = EtcdSalts(tmp_path / "late", [etcd.endpoint], "race")  # a node joining later reads the same
    assert {t: late.salt(t) for t in tenants} == got[0]
    for salts in (*nodes, late):
        salts.close()


def test_a_copied_salt_file_is_kept_when_salts_move_to_etcd(etcd, tmp_path: Path) -> None:
    """An existing cluster whose operator copied tenant-salts.json keeps its namespace ids:
    the first node proposes its file's salt, the others read it from etcd."""
    old = bytes(range(16))
    (tmp_path / "n1").mkdir(mode=0o700)
    (tmp_path / "n1" / FILE_NAME).write_text(json.dumps({"version": 1, "salts": {"a": old.hex()}}))
    first, second = EtcdSalts(tmp_path / "n1", [etcd.endpoint], "c"), EtcdSalts(tmp_path / "n2", [etcd.endpoint], "c")
    first.ensure(["a"])
    assert first.salt("a") == old and second.salt("a") == old
    first.close()
    second.close()


async def test_durable_pages_are_found_after_etcd_is_wiped_and_the_node_restarts(cluster_nodes, etcd: EtcdProcess,
                                                                                tmp_path: Path, monkeypatch) -> None:
    """Bug: tenant salts lived only in etcd, so a node restarted on a wiped
    etcd made a new salt for tenant a: its durable pages stayed on SSD under namespace ids no
    client could name any more. Now a node keeps a local copy (0600) of every salt it uses and
    proposes it to the empty etcd."""
    ca = CertAuthority(tmp_path / "ca")
    monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", NODE_TOKEN)
    args = secure_args(tmp_path, ca, ["a"], NODE_TOKEN)
    salt_file = tmp_path / "a" / "data" / FILE_NAME
    salt_file.unlink()  # no file copied by an operator: the salts are made in etcd
    (node,) = cluster_nodes(["a"], "tcp", *args["a"])
    engine = ca.issue("engine")
    tls = ClientTLS(ca=ca.cert, cert=engine.cert, key=engine.key)
    tokens = tokens_of(34, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=34)
    async with KVStoreClient(node.address, NS, token=A, tls=tls) as client:
        assert await client.put(tokens, kv, durable=True) == len(tokens)
        ns = client.namespace.namespace_id
    node.stop()
    etcd.wipe()
    node.start()
    async with KVStoreClient(node.address, NS, token=A, tls=tls) as client:
        assert client.namespace.namespace_id == ns, "tenant a got a new salt after etcd was wiped"
        await eventually(lambda: _found(client, tokens), 10, "a's durable pages after the restart")
        out = torch.zeros_like(kv)
        assert await client.get(await client.lookup(tokens), out) == len(tokens)
        assert torch.equal(out, kv)
    assert stat.S_IMODE(salt_file.stat().st_mode) == 0o600


def test_a_wiped_etcd_gets_the_salts_back_from_the_nodes_that_knew_them(etcd: EtcdProcess, tmp_path: Path) -> None:
    """Bug: a node kept its salts in memory only, so after etcd was
    replaced a node meeting the tenant made a new one. Now every node that knew a salt (in
    memory or in its local file) puts it back with ``reseed``, exactly once across nodes
    reseeding at the same time, and a node that never knew it reads the same salt."""
    tenants = [f"t{i}" for i in range(8)]
    first = EtcdSalts(tmp_path / "n1", [etcd.endpoint], "c")
    first.ensure(tenants)  # created in etcd by n1
    second = EtcdSalts(tmp_path / "n2", [etcd.endpoint], "c")
    second.ensure(tenants)  # read from etcd by n2
    salts = {t: first.salt(t) for t in tenants}
    assert {t: second.salt(t) for t in tenants} == salts
    for node in ("n1", "n2"):
        assert stat.S_IMODE((tmp_path / node / FILE_NAME).stat().st_mode) == 0o600
    etcd.wipe()
    start = threading.Barrier(2)
    recreated: list[list[str]] = [[], []]

    def reseed(i: int, salts_of_node: EtcdSalts) -> None:
        start.wait()
        recreated[i] = salts_of_node.reseed()

    threads = [threading.Thread(target=reseed, args=(i, n)) for i, n in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(recreated[0] + recreated[1]) == tenants  # each salt put back by one node
    assert first.reseed() == [] and second.reseed() == []  # idempotent
    late = EtcdSalts(tmp_path / "late", [etcd.endpoint], "c")  # never knew them: reads the same
    assert {t: late.salt(t) for t in tenants} == salts
    for salts_of_node in (first, second, late):
        salts_of_node.close()


def test_a_restarted_node_proposes_the_salts_it_learned_to_a_wiped_etcd(etcd: EtcdProcess, tmp_path: Path) -> None:
    """Bug: a node that only read a tenant's salt from etcd wrote it
    nowhere, so restarted on a wiped etcd it made a new one. Now it proposes its local copy."""
    EtcdSalts(tmp_path / "creator", [etcd.endpoint], "c").ensure(["a"])
    reader = EtcdSalts(tmp_path / "reader", [etcd.endpoint], "c")
    old = reader.salt("a")
    reader.close()
    etcd.wipe()
    restarted = EtcdSalts(tmp_path / "reader", [etcd.endpoint], "c")
    assert restarted.salt("a") == old
    restarted.close()


def test_etcd_wins_over_a_local_copy_that_differs(etcd: EtcdProcess, tmp_path: Path, caplog) -> None:
    """A node that knew tenant a's salt, an etcd wiped, and a node that never met a made a new
    salt first: the cluster keeps etcd's (every node must fold the same one; the others already
    use it), the node adopts it in memory and in its file, and says loudly which pages it lost."""
    knew = EtcdSalts(tmp_path / "knew", [etcd.endpoint], "c")
    old = knew.salt("a")
    etcd.wipe()
    fresh = EtcdSalts(tmp_path / "fresh", [etcd.endpoint], "c")
    new = fresh.salt("a")
    assert new != old
    with caplog.at_level(logging.ERROR, logger="kvstore.cluster.salt_records"):
        assert knew.reseed() == []
    assert knew.salt("a") == new
    assert any(r.levelno == logging.ERROR and "unreachable" in r.getMessage() for r in caplog.records)
    restarted = EtcdSalts(tmp_path / "knew", [etcd.endpoint], "c")
    assert restarted.salt("a") == new
    for salts_of_node in (knew, fresh, restarted):
        salts_of_node.close()
