"""The hostile-tenant suite's attacks on sessions, their migration and handoffs (split from
test_hostile_tenant.py, whose COVERAGE names these tests): tenant B, knowing A's namespace id,
keys, session id and handoff id, on the same real server with TLS and tokens (the ``world``
fixture of tenants.py; A is checked whole after each test)."""

from __future__ import annotations

import secrets

import grpc
from support.tenants import LAYOUT, PAGE_BYTES, World, new_keys

from kvstore._proto import data_pb2, handoff_pb2, handoff_pb2_grpc, migration_pb2, migration_pb2_grpc
from kvstore.server.session_owners import FENCED, Ownership

pytest_plugins = ["support.tenants"]  # its ca, world and a_is_intact fixtures

DENIED, OK = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK


def test_b_cannot_take_or_disturb_as_handoffs(world: World) -> None:
    """Handoffs (DESIGN §12.7): A hands its pages over (a handoff completed at this node, the decode node). B,
    knowing A's namespace id, keys and handoff id, waits for it (nothing, at its deadline, as for
    an id nobody made), completes it again, opens it: A's handoff is whole afterwards."""
    a, b, ns, keys = world.a, world.b, world.ns, world.keys
    ident = secrets.token_bytes(16)
    on_a, on_b = handoff_pb2_grpc.HandoffStub(a.channel), handoff_pb2_grpc.HandoffStub(b.channel)
    assert a(on_a.Complete, handoff_pb2.CompleteHandoffRequest(namespace_id=ns, handoff_id=ident, keys=keys)).num_pages == 4
    wait = handoff_pb2.WaitHandoffRequest(namespace_id=ns, handoff_id=ident, keys=keys, deadline_ms=300)
    for other in (ident, secrets.token_bytes(16)):
        assert b(on_b.Wait, handoff_pb2.WaitHandoffRequest(namespace_id=ns, handoff_id=other, keys=keys, deadline_ms=300)) == \
            handoff_pb2.WaitHandoffResponse()
    assert b(on_b.Complete, handoff_pb2.CompleteHandoffRequest(namespace_id=ns, handoff_id=ident, keys=keys)).num_pages == 0
    b(on_b.Open, handoff_pb2.OpenHandoffRequest(namespace_id=ns, handoff_id=ident, to_node="n2", keys=keys))
    assert len(world.server.handoffs) == 1  # A's alone: B's waits left nothing
    assert a(on_a.Wait, wait).num_pages == 4
    lease = a(a.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys))  # A takes its pages over
    a(a.data.Release, data_pb2.ReleaseRequest(lease_id=lease.lease_id))
    assert len(world.server.handoffs) == 0 and not world.server.core.view().pinned


def test_b_cannot_read_extend_or_end_as_session(world: World) -> None:
    b, ns = world.b, world.ns
    assert b(b.data.GetSession, data_pb2.GetSessionRequest(namespace_id=ns, session_id="s")) == data_pb2.GetSessionResponse()
    append = data_pb2.AppendTokensRequest(namespace_id=ns, session_id="s", expected_length=3, tokens=[666])
    assert b.code(b.data.AppendTokens, append) == DENIED
    assert b.code(b.data.EndSession, data_pb2.EndSessionRequest(namespace_id=ns, session_id="s")) == OK


def test_b_cannot_move_fence_or_probe_as_session(world: World) -> None:
    """Live migration (DESIGN §12.8): B, knowing A's namespace id and session id, copies it to this node, fences it
    (which would stop A's writes), adopts it with its own tokens, aborts it: each is refused as
    an append is, before anything changes; Status answers B as for a session that does not exist."""
    b, ns = world.b, world.ns
    on_b = migration_pb2_grpc.MigrationStub(b.channel)
    for method, request in (
        (on_b.Copy, migration_pb2.CopySessionRequest(namespace_id=ns, session_id="s", source="n2", keys=world.keys,
                                                     page_bytes=PAGE_BYTES, tokens=[666])),
        (on_b.Fence, migration_pb2.FenceSessionRequest(namespace_id=ns, session_id="s", to_node="n2")),
        (on_b.Adopt, migration_pb2.AdoptSessionRequest(namespace_id=ns, session_id="s", version=1, tokens=[666])),
        (on_b.Adopt, migration_pb2.AdoptSessionRequest(namespace_id=ns, session_id="s", force=True, source="n2")),
        (on_b.Abort, migration_pb2.AbortSessionRequest(namespace_id=ns, session_id="s")),
    ):
        assert b.code(method, request) == DENIED
    assert b(on_b.Status, migration_pb2.SessionStatusRequest(namespace_id=ns, session_id="s", to_node="n2")) == \
        migration_pb2.SessionStatusResponse(node=world.server.config.node)
    assert world.server.session_owners.items() == []  # nothing fenced, copied or adopted
    a = world.a
    append = data_pb2.AppendTokensRequest(namespace_id=ns, session_id="s", expected_length=3, tokens=[])
    assert a(a.data.AppendTokens, append).length == 3  # A still writes its session


def test_a_fenced_session_of_a_is_denied_to_b_not_described(world: World) -> None:
    """A's session moved away (fenced here): B naming it in an append or a save is refused as
    any write into A's namespace is (PERMISSION_DENIED), not with A's SessionFenced, which names
    the node and version that own A's session now."""
    b, ns = world.b, world.ns
    world.server.session_owners.put(ns, "moved", Ownership(1, FENCED, "n2"))
    try:
        append = data_pb2.AppendTokensRequest(namespace_id=ns, session_id="moved", expected_length=0, tokens=[666])
        allocate = data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(1), session_id="moved")
        assert b.code(b.data.AppendTokens, append) == DENIED
        assert b.code(b.data.Allocate, allocate) == DENIED
    finally:
        world.server.session_owners.drop(ns, "moved")
