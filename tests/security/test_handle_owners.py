"""Allocation and lease handles are bound to the tenant that made them: another tenant that
learnt one (a log line, a shared debug dump) gets what an unknown handle gets, and the
handle keeps working for its owner."""

from __future__ import annotations

import secrets

import grpc
from support.tenants import LAYOUT, OPS, A, B, Caller, map_own_arena, new_keys, new_ns

from kvstore._proto import data_pb2
from kvstore.page import checksum

pytest_plugins = ["support.tenants"]  # its ca and tenant_server fixtures


def test_another_tenant_cannot_commit_or_abort_an_allocation(tenant_server, ca) -> None:
    """Bug: handles were checked for existence only: a tenant holding another's allocation
    id could abort it (its writer's pages lost) or commit it."""
    a, b, ops = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B), Caller(tenant_server, ca, OPS)
    ns, keys = new_ns(), new_keys(2)
    alloc = a(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=keys))
    unknown = secrets.token_bytes(16)
    for caller in (b, ops):
        commit = data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=keys, checksums=[1, 2])
        assert caller.code(caller.data.Commit, commit) == \
            caller.code(caller.data.Commit, data_pb2.CommitRequest(allocation_id=unknown)) == grpc.StatusCode.ABORTED
        assert caller.code(caller.data.Abort, data_pb2.AbortRequest(allocation_id=alloc.allocation_id)) == \
            caller.code(caller.data.Abort, data_pb2.AbortRequest(allocation_id=unknown)) == grpc.StatusCode.OK
    assert tenant_server.core.view().num_allocations == 1
    with map_own_arena(tenant_server, A) as arena:  # the writer fills its slots as a same-host client does
        sums = []
        for slot in alloc.slots:
            data = secrets.token_bytes(alloc.page_bytes)
            arena[slot.offset : slot.offset + len(data)] = data
            sums.append(checksum(data))
    done = a(a.data.Commit, data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=keys, checksums=sums))
    assert done.num_published == 2


def test_another_tenant_cannot_release_or_renew_a_lease(tenant_server, ca) -> None:
    """Bug: a tenant holding another's lease id could release it (the reader's pages may be
    evicted under it) or keep it alive forever with Renew."""
    a, b = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B)
    ns, keys = new_ns(), new_keys(2)
    assert a.put(ns, keys) == 2
    acquired = a(a.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys)).lease_id
    unknown = secrets.token_bytes(16)
    assert b.code(b.data.Release, data_pb2.ReleaseRequest(lease_id=acquired)) == \
        b.code(b.data.Release, data_pb2.ReleaseRequest(lease_id=unknown)) == grpc.StatusCode.OK
    assert b.code(b.data.Renew, data_pb2.RenewRequest(lease_id=acquired)) == \
        b.code(b.data.Renew, data_pb2.RenewRequest(lease_id=unknown)) == grpc.StatusCode.ABORTED
    assert tenant_server.core.view().lease_ids == {acquired}
    a(a.data.Renew, data_pb2.RenewRequest(lease_id=acquired))
    a(a.data.Release, data_pb2.ReleaseRequest(lease_id=acquired))
    assert tenant_server.core.view().lease_ids == frozenset()
