"""The node right on one real server (TLS, tokens): what a cluster node's call may do, for
which tenant. Records a node publishes for tenant a bind a's namespace to a and are listed to
a alone; a node asking for tenant b gets nothing of a's; a malformed tenant is a clear error."""

from __future__ import annotations

import grpc
from support.tenants import NODE, A, B, Caller, new_keys, new_ns

from kvstore._proto import common_pb2, data_pb2, directory_pb2

pytest_plugins = ["support.tenants"]  # its ca and tenant_server fixtures


def _records(keys: list[bytes], node: str = "n2") -> list[directory_pb2.PageRecord]:
    return [directory_pb2.PageRecord(key=k, location=common_pb2.Location(node=node, tier="host", size_bytes=64)) for k in keys]


def test_records_a_node_publishes_for_a_tenant_are_that_tenants(tenant_server, ca) -> None:
    node, a, b = Caller(tenant_server, ca, NODE), Caller(tenant_server, ca, A), Caller(tenant_server, ca, B)
    ns, keys = new_ns(), new_keys(3)
    node(node.directory.Publish, directory_pb2.PublishRequest(namespace_id=ns, records=_records(keys), tenant="a"))
    assert tenant_server.tenancy.owners.owner(ns) == "a"
    assert a.lookup(ns, keys) == 3 and b.lookup(ns, keys) == 0
    for tenant, found in (("a", 3), ("b", 0)):
        asked = directory_pb2.LookupRequest(namespace_id=ns, keys=keys, local_only=True, tenant=tenant)
        assert node(node.directory.Lookup, asked).num_pages == found
    # records for b into a's namespace: refused, nothing listed
    other = new_keys(1)
    refused = directory_pb2.PublishRequest(namespace_id=ns, records=_records(other), tenant="b")
    assert node.code(node.directory.Publish, refused) == grpc.StatusCode.PERMISSION_DENIED
    assert tenant_server.core.directory.get(other[0]) is None
    # withdrawn by the node that published them
    removed = node(node.directory.Remove, directory_pb2.RemoveRequest(namespace_id=ns, keys=keys, node="n2"))
    assert removed.num_removed == 3 and a.lookup(ns, keys) == 0


def test_a_node_reads_only_for_the_namespaces_tenant(tenant_server, ca) -> None:
    node, a = Caller(tenant_server, ca, NODE), Caller(tenant_server, ca, A)
    ns, keys = new_ns(), new_keys(2)
    assert a.put(ns, keys) == 2
    for tenant, found in (("a", 2), ("b", 0)):
        pages = node.stream(node.data.ReadPages, data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys, local_only=True, tenant=tenant))
        assert len(pages) == found
    assert not tenant_server.core.view().pinned


def test_a_malformed_tenant_or_replica_count_is_a_clear_error(tenant_server, ca) -> None:
    node, a = Caller(tenant_server, ca, NODE), Caller(tenant_server, ca, A)
    ns, keys = new_ns(), new_keys(1)
    bad = directory_pb2.PublishRequest(namespace_id=ns, records=_records(keys), tenant="a/../b")
    assert node.code(node.directory.Publish, bad) == grpc.StatusCode.INVALID_ARGUMENT
    for replicas in (0, 17):
        request = data_pb2.ReplicateRequest(namespace_id=ns, keys=keys, replicas=replicas)
        assert a.code(a.data.Replicate, request) == grpc.StatusCode.INVALID_ARGUMENT
    assert a.code(a.data.Replicate, data_pb2.ReplicateRequest(namespace_id=ns, keys=keys, replicas=2)) == \
        grpc.StatusCode.INVALID_ARGUMENT  # a single server: no other node to hold a copy
    assert tenant_server.tenancy.owners.owner(ns) is None and tenant_server.core.directory.get(keys[0]) is None
