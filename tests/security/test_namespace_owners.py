"""Namespace ownership on a real server with TLS and tokens: a namespace belongs to the tenant
whose write first succeeded in it (kept across a restart; a rejected request binds
nothing); the client learns its tenant's salt with WhoAmI and folds it into its namespace."""

from __future__ import annotations

import grpc
import pytest
import torch
from support.kv import random_kv
from support.tenants import LAYOUT, OPS, READER, WRITER, A, B, Caller, new_keys, new_ns, quarantine_a_page, tenant_config

from kvstore import KVLayout, Namespace, validate
from kvstore._proto import common_pb2, data_pb2, directory_pb2
from kvstore.client import ClientTLS, KVStoreClient
from kvstore.security.identity import Identity, Rights
from kvstore.server import Server

DENIED = grpc.StatusCode.PERMISSION_DENIED


pytest_plugins = ["support.tenants"]  # its ca and tenant_server fixtures


def test_whoami_names_the_caller_its_rights_and_its_salt(tenant_server, ca) -> None:
    a, b, ops = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B), Caller(tenant_server, ca, OPS)
    me = a(a.data.WhoAmI, data_pb2.WhoAmIRequest())
    assert (me.tenant, list(me.rights)) == ("a", ["read", "write"])
    assert me.salt == tenant_server.security.salts.salt("a") and len(me.salt) == 16
    assert b(b.data.WhoAmI, data_pb2.WhoAmIRequest()).salt not in (me.salt, b"")
    assert list(ops(ops.data.WhoAmI, data_pb2.WhoAmIRequest()).rights) == ["read", "write", "admin"]


def test_whoami_without_an_auth_file_is_the_local_tenant_without_salt(server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        from kvstore._proto import data_pb2_grpc

        me = data_pb2_grpc.DataStub(channel).WhoAmI(data_pb2.WhoAmIRequest(), timeout=10)
    assert (me.tenant, list(me.rights), me.salt) == ("local", ["read", "write", "admin", "node"], b"")  # without auth: everything


async def test_a_client_with_a_token_folds_its_tenant_salt_into_its_namespace(tenant_server, ca, layout: KVLayout) -> None:
    """Two tenants configured with the same model get different namespace ids, so neither
    finds the other's pages even when they computed the same prompt."""
    ns = Namespace("m", "r1", layout)
    tls = ClientTLS(ca=ca.cert)
    tokens = torch.arange(4 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(tenant_server.address, ns, token=A, tls=tls, use_shm=False) as alice, \
            KVStoreClient(tenant_server.address, ns, token=B, tls=tls, use_shm=False) as bob:
        assert alice.namespace.tenant_salt == tenant_server.security.salts.salt("a").hex()
        assert alice.namespace.namespace_id not in (ns.namespace_id, bob.namespace.namespace_id)
        assert await alice.put(tokens, kv) == len(tokens)
        assert (await alice.lookup(tokens)).num_tokens == len(tokens)
        assert (await bob.lookup(tokens)).num_tokens == 0
    assert tenant_server.tenancy.owners.owner(alice.namespace.namespace_id) == "a"


def test_another_tenant_cannot_write_into_a_namespace(tenant_server, ca) -> None:
    a, b = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B)
    ns, keys = new_ns(), new_keys(3)
    assert a.put(ns, keys) == 3
    with pytest.raises(grpc.RpcError) as err:
        b.put(ns, new_keys(1))
    assert err.value.code() == DENIED
    assert b.code(b.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(1))) == DENIED
    assert b.code(b.data.AppendTokens, data_pb2.AppendTokensRequest(namespace_id=ns, session_id="s", tokens=[1])) == DENIED
    record = directory_pb2.PageRecord(key=new_keys(1)[0], location=common_pb2.Location(node="n2", tier="remote", size_bytes=1))
    assert b.code(b.directory.Publish, directory_pb2.PublishRequest(namespace_id=ns, records=[record])) == DENIED
    # the admin right is not the right to write into another tenant's namespace (cache poisoning)
    ops = Caller(tenant_server, ca, OPS)
    assert ops.code(ops.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(1))) == DENIED
    assert tenant_server.core.view().num_allocations == 0
    assert a.lookup(ns, keys) == 3


def test_reads_of_another_tenants_namespace_answer_as_for_an_empty_one(tenant_server, ca) -> None:
    """No oracle: what B gets for A's namespace is exactly what it gets for a fresh one."""
    a, b = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B)
    ns, keys = new_ns(), new_keys(2)
    assert a.put(ns, keys) == 2
    a(a.data.AppendTokens, data_pb2.AppendTokensRequest(namespace_id=ns, session_id="s", tokens=[1, 2, 3], prompt_tokens=2))

    def answers(target: bytes) -> list[object]:
        acquire = b(b.data.Acquire, data_pb2.AcquireRequest(namespace_id=target, keys=keys))
        return [
            b(b.directory.Lookup, directory_pb2.LookupRequest(namespace_id=target, keys=keys)),
            (list(acquire.pages), acquire.page_bytes, len(acquire.lease_id)),
            b.stream(b.data.ReadPages, data_pb2.ReadPagesRequest(namespace_id=target, keys=keys)),
            b(b.data.GetSession, data_pb2.GetSessionRequest(namespace_id=target, session_id="s")),
            b(b.data.Hint, data_pb2.HintRequest(namespace_id=target, entries=[data_pb2.HintEntry(keys=keys)])),
        ]

    assert answers(ns) == answers(new_ns())
    assert a.lookup(ns, keys) == 2


def test_invalidate_remove_and_session_deletion_by_another_tenant_change_nothing(tenant_server, ca) -> None:
    a, b = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B)
    ns, keys = new_ns(), new_keys(2)
    assert a.put(ns, keys) == 2
    a(a.data.AppendTokens, data_pb2.AppendTokensRequest(namespace_id=ns, session_id="s", tokens=[1, 2]))
    assert b(b.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=ns)).num_removed == 0
    assert b(b.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=ns, keys=keys)).num_removed == 0
    assert b(b.directory.Remove, directory_pb2.RemoveRequest(namespace_id=ns, keys=keys)).num_removed == 0
    b(b.data.EndSession, data_pb2.EndSessionRequest(namespace_id=ns, session_id="s"))
    assert a.lookup(ns, keys) == 2
    assert a(a.data.GetSession, data_pb2.GetSessionRequest(namespace_id=ns, session_id="s")).found


def test_the_admin_reads_and_invalidates_any_namespace(tenant_server, ca) -> None:
    a, ops = Caller(tenant_server, ca, A), Caller(tenant_server, ca, OPS)
    ns, keys = new_ns(), new_keys(2)
    assert a.put(ns, keys) == 2
    assert ops.lookup(ns, keys) == 2
    assert ops(ops.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=ns)).num_removed == 2
    assert a.lookup(ns, keys) == 0


def test_a_caller_without_the_right_is_denied(tenant_server, ca) -> None:
    reader, writer = Caller(tenant_server, ca, READER), Caller(tenant_server, ca, WRITER)
    ns = new_ns()
    assert writer.put(ns, new_keys(1)) == 1  # binds ns to tenant a
    assert reader.code(reader.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(1))) == DENIED
    assert writer.code(writer.directory.Lookup, directory_pb2.LookupRequest(namespace_id=ns, keys=new_keys(1))) == DENIED
    assert reader.code(reader.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=ns)) == DENIED
    assert reader.code(reader.directory.Quarantine, directory_pb2.QuarantineRequest(purge=True)) == DENIED


class _GoneContext:
    """A caller whose deadline passed while its Allocate made room: nobody hears the answer."""

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return 0.0


def test_an_allocate_its_caller_left_binds_nothing(tenant_server, ca) -> None:
    """An Allocate whose deadline passed while it made room is given back (nobody hears of it);
    the namespace must not stay bound to its caller either (a rejected request leaves no
    binding): another tenant's write into it is then its first. Found by review: the claim was
    settled as a success before the gate saw the caller gone."""
    b = Identity(tenant="b", rights=Rights.READ | Rights.WRITE, salt=b"\0" * 16)
    ns = new_ns()
    gate = tenant_server._data.gate
    ident, _slots, alloc, _token = gate.allocate(b, ns, validate.layout(LAYOUT), new_keys(1), None, None, "", _GoneContext())
    assert alloc is None and tenant_server.core.leases.allocation(ident) is None, "the allocation was not given back"
    assert tenant_server.tenancy.owners.owner(ns) is None, "an Allocate nobody heard of bound the namespace"
    a = Caller(tenant_server, ca, A)
    assert a.put(ns, new_keys(1)) == 1
    assert tenant_server.tenancy.owners.owner(ns) == "a"


def test_a_rejected_request_binds_nothing(tenant_server, ca) -> None:
    a, b = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B)
    ns = new_ns()
    bad = common_pb2.Layout(num_layers=2, kv_factor=2, num_kv_heads=1, head_dim=8, dtype="nope", page_tokens=4)
    assert b.code(b.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=bad, keys=new_keys(1))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert b.code(b.data.AppendTokens, data_pb2.AppendTokensRequest(namespace_id=ns, session_id="s", expected_length=5,
                                                                    tokens=[1])) != grpc.StatusCode.OK
    assert tenant_server.tenancy.owners.owner(ns) is None
    assert a.put(ns, new_keys(1)) == 1
    assert tenant_server.tenancy.owners.owner(ns) == "a"


def test_ownership_survives_a_restart(tmp_path, ca) -> None:
    config = tenant_config(tmp_path, ca)
    ns = new_ns()
    server = Server(config)
    server.start()
    try:
        assert Caller(server, ca, A).put(ns, new_keys(1)) == 1
    finally:
        server.stop(grace_s=1)
    server = Server(config)
    server.start()
    try:
        b = Caller(server, ca, B)
        assert b.code(b.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(1))) == DENIED
        assert server.tenancy.owners.owner(ns) == "a"
    finally:
        server.stop(grace_s=1)


def test_subscribe_stats_and_quarantine_show_only_the_callers_namespaces(tenant_server, ca) -> None:
    a, b, ops = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B), Caller(tenant_server, ca, OPS)
    ns_a, ns_b = new_ns(), new_ns()
    assert a.put(ns_a, new_keys(3)) == 3
    assert b.put(ns_b, new_keys(2)) == 2
    for caller, expected in ((b, {ns_b}), (ops, {ns_a, ns_b})):
        events = caller.directory.Subscribe(directory_pb2.SubscribeRequest(from_seq=1), metadata=caller.metadata, timeout=10)
        seen = set()
        for event in events:
            seen.add(event.namespace_id)
            if event.seq >= tenant_server.core.directory.events.last_seq:
                break
        events.cancel()
        assert seen == expected
    stats = b(b.directory.Stats, directory_pb2.StatsRequest())
    assert stats.num_entries == 2
    assert sum(t.num_pages for t in stats.tiers) == 2
    assert ops(ops.directory.Stats, directory_pb2.StatsRequest()).num_entries == 5
    key = quarantine_a_page(tenant_server, a, ns_a)
    assert b(b.directory.Quarantine, directory_pb2.QuarantineRequest()).pages == []
    assert {p.key for p in a(a.directory.Quarantine, directory_pb2.QuarantineRequest()).pages} == {key}  # read-up copy and disk copy
    assert {p.key for p in ops(ops.directory.Quarantine, directory_pb2.QuarantineRequest()).pages} == {key}
