"""The hostile-tenant suite (DESIGN §11): tenants A and B on one real server with TLS and bearer
tokens. B knows A's namespace id, keys, session id and handles (the worst case: they leaked)
and tries every RPC on them; A's data stays unread, unchanged and unprobed. Callers without
a valid token are refused before any handler runs; a revoked token stops working after a
SIGHUP. ``COVERAGE`` maps every RPC of the protos to the test that attacks it, and a test
fails when an RPC is added without an entry."""

from __future__ import annotations

import json
import queue
import secrets
import signal
import threading

import grpc
import pytest
import test_hostile_tenant_sessions  # the session, migration and handoff attacks COVERAGE names
from support.secure_server import call_raw, every_method, tls_channel
from support.servers import ServerProcess
from support.tenants import (
    LAYOUT,
    PAGE_BYTES,
    READER,
    A,
    B,
    Caller,
    World,
    map_own_arena,
    new_keys,
    new_ns,
    quarantine_a_page,
    tenant_config,
    tenant_grants,
)

from kvstore._proto import common_pb2, data_pb2, directory_pb2, handoff_pb2, handoff_pb2_grpc
from kvstore.page import ARENA_MAGIC, checksum

pytest_plugins = ["support.tenants"]  # its ca, world and a_is_intact fixtures

DENIED, OK = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK

COVERAGE = {
    "Data.GetInfo": "test_b_learns_nothing_of_a_from_getinfo_and_whoami",  # and test_b_is_handed_only_its_own_arena
    "Data.WhoAmI": "test_b_learns_nothing_of_a_from_getinfo_and_whoami",
    "Data.Allocate": "test_b_cannot_write_into_as_namespace",
    "Data.Commit": "test_b_cannot_commit_or_abort_as_allocation",
    "Data.Abort": "test_b_cannot_commit_or_abort_as_allocation",
    "Data.Acquire": "test_b_cannot_read_as_pages",
    "Data.Release": "test_b_cannot_release_or_renew_as_leases",
    "Data.Renew": "test_b_cannot_release_or_renew_as_leases",
    "Data.WritePages": "test_b_cannot_write_into_as_namespace",
    "Data.ReadPages": "test_b_cannot_read_as_pages",
    "Data.Hint": "test_b_cannot_hint_as_keys",
    "Data.AppendTokens": "test_b_cannot_read_extend_or_end_as_session",
    "Data.GetSession": "test_b_cannot_read_extend_or_end_as_session",
    "Data.EndSession": "test_b_cannot_read_extend_or_end_as_session",
    "Data.Replicate": "test_tenants_cannot_make_the_node_only_calls",
    "Data.GrantTransfer": "test_tenants_cannot_make_the_node_only_calls",
    "Directory.Lookup": "test_b_cannot_probe_as_namespace_with_lookup",
    "Directory.Publish": "test_b_cannot_write_into_as_namespace",
    "Directory.Remove": "test_b_cannot_invalidate_or_remove_as_pages",
    "Directory.Invalidate": "test_b_cannot_invalidate_or_remove_as_pages",
    "Directory.Subscribe": "test_b_cannot_subscribe_to_as_events",
    "Directory.Stats": "test_b_cannot_see_a_in_stats",
    "Directory.Quarantine": "test_b_cannot_list_or_purge_as_quarantined_pages",
    "Handoff.Open": "test_b_cannot_take_or_disturb_as_handoffs",
    "Handoff.Complete": "test_b_cannot_take_or_disturb_as_handoffs",
    "Handoff.Wait": "test_b_cannot_take_or_disturb_as_handoffs",
    "Handoff.Push": "test_tenants_cannot_make_the_node_only_calls",
    "Handoff.PushLayers": "test_tenants_cannot_make_the_node_only_calls",
    "Migration.Copy": "test_b_cannot_move_fence_or_probe_as_session",
    "Migration.Fence": "test_b_cannot_move_fence_or_probe_as_session",
    "Migration.Adopt": "test_b_cannot_move_fence_or_probe_as_session",
    "Migration.Abort": "test_b_cannot_move_fence_or_probe_as_session",
    "Migration.Status": "test_b_cannot_move_fence_or_probe_as_session",
}

# What only nodes may do (the node right), each attacked by test_tenants_cannot_make_the_node_only_calls:
# whole RPCs, and the request fields that make an RPC a node's call.
NODE_ONLY = {"Directory.Publish", "Data.GrantTransfer", "Handoff.Push", "Handoff.PushLayers", "Directory.Remove.node", "Directory.Lookup.local_only",
             "Directory.Lookup.tenant", "Data.ReadPages.local_only", "Data.ReadPages.tenant", "Data.Replicate.holder", "Data.Replicate.tenant"}
_NODE_FIELDS = {"node", "local_only", "tenant", "holder"}  # request fields by these names make a call a node's


def test_every_rpc_is_attacked_by_this_suite() -> None:
    """Fails when an RPC is added to a .proto without a hostile-tenant test (and an auth check)."""
    declared = {f"{s.name}.{m.name}" for s, m in every_method()}
    assert declared == set(COVERAGE), f"not covered: {sorted(declared - set(COVERAGE))}; gone: {sorted(set(COVERAGE) - declared)}"
    for test in set(COVERAGE.values()):
        assert callable(globals().get(test) or getattr(test_hostile_tenant_sessions, test, None)), \
            f"COVERAGE names {test}, which is not a test here or in test_hostile_tenant_sessions.py"


def test_every_node_only_field_is_attacked() -> None:
    """Fails when a request field that makes a call a node's (by its name) is added without an
    entry in NODE_ONLY, or an entry names a field that is gone."""
    declared = {f"{s.name}.{m.name}" for s, m in every_method()}
    fields = {f"{s.name}.{m.name}.{f.name}" for s, m in every_method() for f in m.input_type.fields
              if f.name in _NODE_FIELDS and f"{s.name}.{m.name}" not in NODE_ONLY}
    assert fields == {n for n in NODE_ONLY if n.count(".") == 2}
    assert {n for n in NODE_ONLY if n.count(".") == 1} <= declared
    assert COVERAGE["Data.Replicate"] == "test_tenants_cannot_make_the_node_only_calls"


def test_b_learns_nothing_of_a_from_getinfo_and_whoami(world: World) -> None:
    b = world.b
    me = b(b.data.WhoAmI, data_pb2.WhoAmIRequest())
    assert me.tenant == "b" and me.salt == world.server.security.salts.salt("b") != world.server.security.salts.salt("a")
    info = b(b.data.GetInfo, data_pb2.GetInfoRequest())
    assert info.node == "local"  # server facts only; the arena is still shared (see README: what is left)


def test_b_cannot_probe_as_namespace_with_lookup(world: World) -> None:
    b = world.b
    assert b(b.directory.Lookup, directory_pb2.LookupRequest(namespace_id=world.ns, keys=world.keys)) == \
        b(b.directory.Lookup, directory_pb2.LookupRequest(namespace_id=new_ns(), keys=world.keys)) == directory_pb2.LookupResponse()


def test_b_cannot_read_as_pages(world: World) -> None:
    b, ns, keys = world.b, world.ns, world.keys
    acquired = b(b.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys))
    assert list(acquired.pages) == [] and acquired.page_bytes == 0
    assert b.stream(b.data.ReadPages, data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys)) == []
    assert not world.server.core.view().pinned, "B's calls pin none of A's pages"


def test_b_cannot_write_into_as_namespace(world: World) -> None:
    b, ns = world.b, world.ns
    assert b.code(b.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=world.keys)) == DENIED
    with pytest.raises(grpc.RpcError) as err:
        b.put(ns, world.keys[:1])  # cache poisoning: A's key, B's bytes
    assert err.value.code() == DENIED
    record = directory_pb2.PageRecord(key=world.keys[0], location=common_pb2.Location(node="evil", tier="remote", size_bytes=1))
    assert b.code(b.directory.Publish, directory_pb2.PublishRequest(namespace_id=ns, records=[record])) == DENIED
    assert world.server.core.view().num_allocations == 0
    assert world.server.core.directory.get(world.keys[0]).locations.keys() == {("local", "host")}


def test_tenants_cannot_make_the_node_only_calls(world: World) -> None:
    """Bug: a node is a caller like any other, but what only nodes do (publishing
    records naming a node, withdrawing a node's records, asking a shard owner with
    local_only, reading for another tenant, replicating from a holder) took a tenant's
    token: B could list A's keys at any node it liked, or withdraw them. Those calls and
    fields now need the node right, which no tenant has (not even A in its own namespace)."""
    a, b, ns, keys = world.a, world.b, world.ns, world.keys
    record = directory_pb2.PageRecord(key=new_keys(1)[0], location=common_pb2.Location(node="n2", tier="host", size_bytes=1))
    for caller in (a, b):
        assert caller.code(caller.directory.Publish, directory_pb2.PublishRequest(namespace_id=ns, records=[record])) == DENIED
        assert caller.code(caller.directory.Remove, directory_pb2.RemoveRequest(namespace_id=ns, keys=keys, node="local")) == DENIED
        for lookup in (directory_pb2.LookupRequest(namespace_id=ns, keys=keys, local_only=True),
                       directory_pb2.LookupRequest(namespace_id=ns, keys=keys, tenant="a")):
            assert caller.code(caller.directory.Lookup, lookup) == DENIED
        for read in (data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys, local_only=True),
                     data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys, tenant="a")):
            with pytest.raises(grpc.RpcError) as err:
                caller.stream(caller.data.ReadPages, read)
            assert err.value.code() == DENIED
        replicate = data_pb2.ReplicateRequest(namespace_id=ns, keys=keys, replicas=2, holder="n2", tenant="a", page_bytes=PAGE_BYTES)
        assert caller.code(caller.data.Replicate, replicate) == DENIED
        assert caller.code(caller.data.GrantTransfer, data_pb2.GrantTransferRequest(node="n2")) == DENIED  # the UCX data port
        push = handoff_pb2.PushHandoffRequest(namespace_id=ns, handoff_id=b"h" * 16, keys=keys, holder="n2", tenant="a",
                                              page_bytes=PAGE_BYTES, complete=True)
        assert caller.code(handoff_pb2_grpc.HandoffStub(caller.channel).Push, push) == DENIED
        layers = handoff_pb2.PushLayersRequest(namespace_id=ns, handoff_id=b"h" * 16, keys=keys, holder="n2", tenant="a",
                                               layout=LAYOUT, offset=0, length=1, allocation=b"x" * 16)
        assert caller.code(handoff_pb2_grpc.HandoffStub(caller.channel).PushLayers, layers) == DENIED
    replicate = data_pb2.ReplicateRequest(namespace_id=ns, keys=keys, replicas=1)
    assert b(b.data.Replicate, replicate).num_pages == 0 and a(a.data.Replicate, replicate).num_pages == len(keys)
    assert world.server.core.directory.get(record.key) is None
    assert world.server.core.directory.get(keys[0]).locations.keys() == {("local", "host")}
    assert not world.server.core.view().pinned


def test_b_cannot_invalidate_or_remove_as_pages(world: World) -> None:
    b, ns, keys = world.b, world.ns, world.keys
    assert b(b.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=ns)).num_removed == 0
    assert b(b.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=ns, keys=keys)).num_removed == 0
    assert b(b.directory.Remove, directory_pb2.RemoveRequest(namespace_id=ns, keys=keys)).num_removed == 0


def test_b_cannot_hint_as_keys(world: World) -> None:
    """A hint protects pages from eviction: B must not pin A's pages in RAM with them."""
    b = world.b
    before = world.server.core.view().num_hinted
    hint = data_pb2.HintRequest(namespace_id=world.ns, entries=[data_pb2.HintEntry(keys=world.keys, eta_ms=60_000)])
    assert list(b(b.data.Hint, hint).reserved) == [True]
    assert world.server.core.view().num_hinted == before


def test_b_cannot_commit_or_abort_as_allocation(world: World) -> None:
    a, b = world.a, world.b
    alloc = a(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=world.ns, layout=LAYOUT, keys=new_keys(1)))
    try:
        commit = data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=[alloc.slots[0].key], checksums=[0])
        assert b.code(b.data.Commit, commit) == grpc.StatusCode.ABORTED  # as for an unknown allocation
        assert b.code(b.data.Abort, data_pb2.AbortRequest(allocation_id=alloc.allocation_id)) == OK
        assert world.server.core.view().num_allocations == 1
    finally:
        a(a.data.Abort, data_pb2.AbortRequest(allocation_id=alloc.allocation_id))
    assert world.server.core.view().num_allocations == 0


def test_b_cannot_release_or_renew_as_leases(world: World) -> None:
    a, b = world.a, world.b
    lease = a(a.data.Acquire, data_pb2.AcquireRequest(namespace_id=world.ns, keys=world.keys)).lease_id
    b(b.data.Release, data_pb2.ReleaseRequest(lease_id=lease))
    assert b.code(b.data.Renew, data_pb2.RenewRequest(lease_id=lease, ttl_ms=600_000)) == grpc.StatusCode.ABORTED
    assert lease in world.server.core.view().lease_ids
    a(a.data.Release, data_pb2.ReleaseRequest(lease_id=lease))
    assert lease not in world.server.core.view().lease_ids


def test_b_cannot_subscribe_to_as_events(world: World) -> None:
    """B's subscription from the first event on shows B's own writes, none of A's."""
    b = world.b
    mine = new_keys(1)
    assert b.put(new_ns(), mine) == 1
    events = b.directory.Subscribe(directory_pb2.SubscribeRequest(from_seq=1), metadata=b.metadata, timeout=10)
    seen = []
    for event in events:
        seen.append(event.key)
        if event.key == mine[0]:
            break
    events.cancel()
    assert seen == mine


def test_b_cannot_see_a_in_stats(world: World) -> None:
    b = world.b
    assert b.put(new_ns(), new_keys(1)) == 1
    stats = b(b.directory.Stats, directory_pb2.StatsRequest())
    own = world.server.tenancy.quotas.usage("b")["host_bytes"] // PAGE_BYTES  # B's pages, however many earlier tests made
    assert stats.num_entries == sum(t.num_pages for t in stats.tiers) == own >= 1
    assert [t.tenant for t in stats.tenants] == ["b"] and dict(stats.ssd) == {}
    assert all(t.hits == t.misses == t.evictions == 0 for t in stats.tiers), "server-wide counters tell of other tenants"


def test_b_cannot_list_or_purge_as_quarantined_pages(world: World) -> None:
    a, b = world.a, world.b
    ns = new_ns()
    key = quarantine_a_page(world.server, a, ns)
    assert b(b.directory.Quarantine, directory_pb2.QuarantineRequest()).pages == []
    assert b.code(b.directory.Quarantine, directory_pb2.QuarantineRequest(purge=True)) == DENIED
    # (the copy read up from disk and the one on disk: both listed)
    assert {p.key for p in a(a.directory.Quarantine, directory_pb2.QuarantineRequest()).pages} == {key}


@pytest.mark.parametrize(("service", "method"), list(every_method()), ids=[f"{s.name}.{m.name}" for s, m in every_method()])
def test_a_caller_without_a_valid_token_is_unauthenticated(world: World, ca, service, method) -> None:
    with tls_channel(world.server.address, ca) as channel:
        for token in (None, "wrong-token-0123456789abcdef", A[:-1] + "X"):
            assert call_raw(channel, service, method, token) == grpc.StatusCode.UNAUTHENTICATED


def test_a_caller_without_the_right_is_permission_denied(world: World, ca) -> None:
    reader = Caller(world.server, ca, READER)
    assert reader.lookup(world.ns, world.keys) == 4  # tenant a, read only
    assert reader.code(reader.data.Allocate, data_pb2.AllocateRequest(namespace_id=world.ns, layout=LAYOUT,
                                                                      keys=new_keys(1))) == DENIED
    assert reader.code(reader.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=world.ns)) == DENIED


def test_a_revoked_token_stops_working_after_sighup(tmp_path, ca) -> None:
    """kvstore-server as a process with TLS and tokens: B's entry is removed from the auth
    file, SIGHUP, and B is refused while A keeps working."""
    config = tenant_config(tmp_path, ca)
    auth, tls = config.security.auth_file, config.security
    assert auth is not None and tls.tls_cert is not None and tls.tls_key is not None
    process = ServerProcess(tmp_path, "--auth-file", str(auth), "--tls-cert", str(tls.tls_cert), "--tls-key", str(tls.tls_key))
    process.args[process.args.index("--log-level") + 1] = "info"
    process.start()
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    try:
        with tls_channel(process.address, ca) as channel:
            stats = next((s, m) for s, m in every_method() if m.name == "Stats")
            assert call_raw(channel, *stats, token=B) == call_raw(channel, *stats, token=A) == OK
            auth.write_text(json.dumps({"tokens": [g for g in tenant_grants() if g["token"] != B]}))
            process.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            while "reloaded" not in lines.get(timeout=20):
                pass
            assert call_raw(channel, *stats, token=B) == grpc.StatusCode.UNAUTHENTICATED
            assert call_raw(channel, *stats, token=A) == OK
    finally:
        assert process.terminate() == 0


def test_a_forged_handle_is_an_unknown_handle(world: World) -> None:
    """Handles are 128-bit random: a guessed one is simply unknown (and changes nothing)."""
    b = world.b
    forged = secrets.token_bytes(16)
    assert b.code(b.data.Renew, data_pb2.RenewRequest(lease_id=forged)) == grpc.StatusCode.ABORTED
    held = world.server.core.view().lease_ids
    b(b.data.Release, data_pb2.ReleaseRequest(lease_id=forged))
    assert world.server.core.view().lease_ids == held


def test_b_cannot_read_as_freed_bytes_through_a_commit_it_did_not_write(world: World) -> None:
    """Bug: a freed landing slot keeps its last page's bytes. B allocated a slot A's page had
    just left, committed it without writing (any checksum: the server believed it) and read
    A's bytes back with ReadPages. Now each tenant's pages are in its own arena: B's slots
    never held A's bytes, whatever offsets they have, and a page B committed without writing
    fails the check the server makes before it sends a page (quarantined, not sent)."""
    a, b = world.a, world.b
    ns, [key] = new_ns(), new_keys(1)
    secret = b"A's secret KV..." * (PAGE_BYTES // 16)
    a.data.WritePages(iter([data_pb2.PageChunk(key=key, namespace_id=ns, layout=LAYOUT, page_bytes=PAGE_BYTES,
                                               checksum=checksum(secret), data=secret)]), metadata=a.metadata, timeout=10)
    assert a(a.directory.Invalidate, directory_pb2.InvalidateRequest(namespace_id=ns)).num_removed == 1
    ns_b, [key_b] = new_ns(), new_keys(1)
    alloc = b(b.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns_b, layout=LAYOUT, keys=[key_b]))
    with map_own_arena(world.server, B) as arena:
        assert secret[:32] not in arena[:], "B's arena never held A's page"
    fake = data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=[key_b], checksums=[12345])
    b(b.data.Commit, fake)
    pages = b.stream(b.data.ReadPages, data_pb2.ReadPagesRequest(namespace_id=ns_b, keys=[key_b]))
    assert pages == [], "a page whose bytes do not match its checksum is not sent"
    assert key_b in [q.key for q in world.server.core.quarantined()]


def test_b_is_handed_only_its_own_arena(world: World) -> None:
    """An arena is one trust domain (whoever maps it reads and writes every page in it): with
    tenants each has its own, announced without a path and handed over by the arena socket to
    the caller's own token only (tests/security/test_tenant_arenas.py attacks it further)."""
    info_a = world.a(world.a.data.GetInfo, data_pb2.GetInfoRequest())
    info_b = world.b(world.b.data.GetInfo, data_pb2.GetInfoRequest())
    assert (info_b.arena_path, info_b.arena_socket) == ("", str(world.server.arena_socket.path))
    assert info_b.arena_token != info_a.arena_token
    with map_own_arena(world.server, B) as arena:
        assert arena[len(ARENA_MAGIC) : len(ARENA_MAGIC) + 16] == info_b.arena_token
