"""The hostile-tenant guarantees on the same-host call socket (DESIGN §11 "Same-host paths"; kvstore/callsocket/frames.py):
every method it serves is one the gRPC hostile suite attacks, and is attacked here again
over the socket (``ATTACKS``, a test fails when a method is added without an entry); a
caller without a valid token is refused at HELLO; a token revoked by a reload (in-process
and by SIGHUP) stops working on a connection already open, for every method."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from support.callsock import SocketCaller, connect, read_answer
from support.certs import CertAuthority
from support.secure_server import ALICE, every_method, grants, write_auth_file
from support.tenants import LAYOUT, A, B, World, hostile_world, new_keys, tenant_config, tenant_grants
from test_hostile_tenant import COVERAGE
from test_reload import LoggedServer

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2
from kvstore.callsocket import frames
from kvstore.callsocket.client_sync import CallChannel
from kvstore.errors import Unauthenticated
from kvstore.security.channel import sync_channel
from kvstore.server import Server

pytest_plugins = ["support.tenants"]  # its ca fixture

DENIED, OK, UNAUTHENTICATED = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED
A2 = "tenant-a-second-token-0123456789"  # tenant a, revoked by the tests
EXPIRED = "tenant-a-expired-token-01234567"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, ca: CertAuthority) -> Iterator[World]:
    """One server for the module; B calls over the call socket."""
    yield from hostile_world(tmp_path_factory.mktemp("server"), ca, lambda server: SocketCaller(server, B))


def _lookup(w: World) -> None:
    found = w.b("Directory.Lookup", directory_pb2.LookupRequest(namespace_id=w.ns, keys=w.keys), directory_pb2.LookupResponse)
    assert found == directory_pb2.LookupResponse()


def _acquire(w: World) -> None:
    acquired = w.b("Data.Acquire", data_pb2.AcquireRequest(namespace_id=w.ns, keys=w.keys), data_pb2.AcquireResponse)
    assert list(acquired.pages) == [] and acquired.page_bytes == 0
    assert not w.server.core.view().pinned, "B's calls pin none of A's pages"


def _release_renew(w: World) -> None:
    lease = w.a(w.a.data.Acquire, data_pb2.AcquireRequest(namespace_id=w.ns, keys=w.keys)).lease_id
    try:
        w.b("Data.Release", data_pb2.ReleaseRequest(lease_id=lease), data_pb2.ReleaseResponse)
        assert w.b.code("Data.Renew", data_pb2.RenewRequest(lease_id=lease, ttl_ms=600_000)) == grpc.StatusCode.ABORTED
        assert lease in w.server.core.view().lease_ids
    finally:
        w.a(w.a.data.Release, data_pb2.ReleaseRequest(lease_id=lease))


def _who(w: World) -> None:
    assert w.b("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse).tenant == "b"
    info = w.b("Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse)
    assert info.arena_path == "" and info.arena_token != w.a(w.a.data.GetInfo, data_pb2.GetInfoRequest()).arena_token


def _allocate(w: World) -> None:
    assert w.b.code("Data.Allocate", data_pb2.AllocateRequest(namespace_id=w.ns, layout=LAYOUT, keys=w.keys)) == DENIED
    assert w.server.core.view().num_allocations == 0


def _commit_abort(w: World) -> None:
    alloc = w.a(w.a.data.Allocate, data_pb2.AllocateRequest(namespace_id=w.ns, layout=LAYOUT, keys=new_keys(1)))
    try:
        commit = data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=[alloc.slots[0].key], checksums=[0])
        assert w.b.code("Data.Commit", commit) == grpc.StatusCode.ABORTED  # as for an unknown allocation
        assert w.b.code("Data.Abort", data_pb2.AbortRequest(allocation_id=alloc.allocation_id)) == OK
        assert w.server.core.view().num_allocations == 1
    finally:
        w.a(w.a.data.Abort, data_pb2.AbortRequest(allocation_id=alloc.allocation_id))


def _hint(w: World) -> None:
    before = w.server.core.view().num_hinted
    hint = data_pb2.HintRequest(namespace_id=w.ns, entries=[data_pb2.HintEntry(keys=w.keys, eta_ms=60_000)])
    assert list(w.b("Data.Hint", hint, data_pb2.HintResponse).reserved) == [True]
    assert w.server.core.view().num_hinted == before


def _session(w: World) -> None:
    got = w.b("Data.GetSession", data_pb2.GetSessionRequest(namespace_id=w.ns, session_id="s"), data_pb2.GetSessionResponse)
    assert got == data_pb2.GetSessionResponse()
    append = data_pb2.AppendTokensRequest(namespace_id=w.ns, session_id="s", expected_length=3, tokens=[666])
    assert w.b.code("Data.AppendTokens", append) == DENIED
    assert w.b.code("Data.EndSession", data_pb2.EndSessionRequest(namespace_id=w.ns, session_id="s")) == OK


ATTACKS: dict[str, Callable[[World], None]] = {
    "Directory.Lookup": _lookup, "Data.Acquire": _acquire, "Data.Release": _release_renew, "Data.Renew": _release_renew,
    "Data.GetInfo": _who, "Data.WhoAmI": _who, "Data.Allocate": _allocate, "Data.Commit": _commit_abort,
    "Data.Abort": _commit_abort, "Data.Hint": _hint, "Data.AppendTokens": _session, "Data.GetSession": _session,
    "Data.EndSession": _session,
}


def test_every_method_of_the_call_socket_is_attacked() -> None:
    """Fails when a method is added to the call socket without an attack here, or when it is
    not a unary RPC the gRPC hostile suite covers (streams stay on gRPC)."""
    unary = {f"{s.name}.{m.name}" for s, m in every_method() if not m.client_streaming and not m.server_streaming}
    assert set(frames.METHODS) <= unary & set(COVERAGE)
    assert set(ATTACKS) == set(frames.METHODS), f"not attacked: {sorted(set(frames.METHODS) - set(ATTACKS))}"
    assert len(set(frames.METHODS)) == len(frames.METHODS)


@pytest.mark.parametrize("method", frames.METHODS)
def test_b_cannot_touch_a_over_the_call_socket(world: World, method: str) -> None:
    ATTACKS[method](world)


@pytest.mark.parametrize("token", [None, "not-a-token", EXPIRED])
def test_hello_without_a_valid_token_is_unauthenticated(tmp_path: Path, ca: CertAuthority, token: str | None) -> None:
    server = Server(tenant_config(tmp_path, ca, tenant_grants([{"tenant": "a", "rights": ["read"], "token": EXPIRED,
                                                                "expires": 1.0}])))
    server.start()
    try:
        sock, status = connect(server, token)
        assert status == UNAUTHENTICATED
        assert read_answer(sock) is None, "a refused connection is closed"
        sock.close()
        assert SocketCaller(server, A)("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse).tenant == "a"
    finally:
        server.stop(grace_s=1)


def test_the_call_socket_is_private(world: World) -> None:
    path = world.server.call_socket.path
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


def test_a_revoked_token_stops_working_on_an_open_connection_for_every_method(tmp_path: Path, ca: CertAuthority) -> None:
    """Each method re-checks its caller after a reload: a method served without that check
    would answer the revoked caller (the request here is empty: authentication comes first)."""
    with_a2 = tenant_grants([{"tenant": "a", "rights": ["read", "write"], "token": A2}])
    server = Server(tenant_config(tmp_path, ca, with_a2))
    server.start()
    auth = tmp_path / "auth.json"
    try:
        for method in frames.METHODS:
            caller = SocketCaller(server, A2)
            assert caller("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse).tenant == "a"
            write_auth_file(auth, tenant_grants())
            assert server.reload_security()
            answer = caller.raw(method, b"")
            assert answer is not None and answer[0] == UNAUTHENTICATED, (method, answer)
            assert read_answer(caller.sock) is None, f"{method}: the connection of a revoked caller is closed"
            caller.close()
            write_auth_file(auth, with_a2)
            assert server.reload_security()
    finally:
        server.stop(grace_s=1)


def test_sighup_revokes_a_token_on_an_open_connection(tmp_path: Path) -> None:
    auth = write_auth_file(tmp_path / "auth.json", grants())
    logged = LoggedServer(tmp_path, auth)
    try:
        with sync_channel(logged.process.address, token=ALICE) as channel:
            info = data_pb2_grpc.DataStub(channel).GetInfo(data_pb2.GetInfoRequest(), timeout=10)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(info.call_socket)
        sock.sendall(frames.request_frame(frames.HELLO, 0, ALICE.encode()))
        hello = read_answer(sock)
        assert hello is not None and hello[0] == OK and hello[1][: frames.CALL_TOKEN_BYTES] == info.call_token
        who = frames.request_frame(frames.METHOD_IDS["Data.WhoAmI"], 10_000, b"")
        sock.sendall(who)
        answer = read_answer(sock)
        assert answer is not None and answer[0] == OK and data_pb2.WhoAmIResponse.FromString(answer[1]).tenant == "alice"
        auth.write_text(json.dumps({"tokens": [g for g in grants() if g["token"] != ALICE]}))
        logged.hangup_and_wait_for("reloaded")
        sock.sendall(who)
        answer = read_answer(sock)
        assert answer is not None and answer[0] == UNAUTHENTICATED
        sock.close()
    finally:
        assert logged.process.terminate() == 0



def test_the_client_channel_follows_a_revocation_and_a_new_grant(tmp_path: Path, ca: CertAuthority) -> None:
    """The client's pooled connection is closed by the server once its token is revoked; the
    channel answers Unauthenticated, and once the token is granted again its next call is
    made on a new connection (the closed one is dropped, the call not lost)."""
    with_a2 = tenant_grants([{"tenant": "a", "rights": ["read", "write"], "token": A2}])
    server = Server(tenant_config(tmp_path, ca, with_a2))
    server.start()
    auth = tmp_path / "auth.json"
    try:
        info = SocketCaller(server, A2)("Data.GetInfo", data_pb2.GetInfoRequest(), data_pb2.GetInfoResponse)
        channel = CallChannel.open(info.call_socket, A2, info.call_token, 5.0)
        assert channel is not None and channel.tenant == "a"
        who = (data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse)
        assert channel.call("Data.WhoAmI", *who).tenant == "a"
        write_auth_file(auth, tenant_grants())
        assert server.reload_security()
        with pytest.raises(Unauthenticated):
            channel.call("Data.WhoAmI", *who)
        with pytest.raises(Unauthenticated):
            channel.call("Data.WhoAmI", *who)  # a new connection: refused at HELLO
        write_auth_file(auth, with_a2)
        assert server.reload_security()
        assert channel.call("Data.WhoAmI", *who).tenant == "a"
        channel.close()
    finally:
        server.stop(grace_s=1)


def test_a_commit_is_checked_against_its_slots_bytes_on_both_transports_with_a_shared_arena(tmp_path: Path,
                                                                                             ca: CertAuthority) -> None:
    """With --share-arena a freed slot keeps the bytes of the page that left it (maybe another
    tenant's): a commit that claims a checksum without writing its slot is refused
    (INVALID_ARGUMENT) and publishes nothing, over gRPC and over the call socket alike (the
    socket serves the very same guarded Commit handler)."""
    import dataclasses

    from support.tenants import PAGE_BYTES, Caller, new_ns

    from kvstore.page import checksum

    config = tenant_config(tmp_path, ca)
    server = Server(dataclasses.replace(config, security=dataclasses.replace(config.security, share_arena=True)))
    server.start()
    try:
        grpc_caller, socket_caller = Caller(server, ca, A), SocketCaller(server, A)
        ns = new_ns()
        claimed = checksum(b"\x07" * PAGE_BYTES)  # bytes never written to the slot
        for name, call in (("grpc", lambda m, r, t: grpc_caller(getattr(grpc_caller.data, m.split(".")[1]), r)),
                           ("socket", socket_caller)):
            key = new_keys(1)
            alloc = call("Data.Allocate", data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=key),
                         data_pb2.AllocateResponse)
            commit = data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=key, checksums=[claimed])
            code = (grpc_caller.code(grpc_caller.data.Commit, commit) if name == "grpc"
                    else socket_caller.code("Data.Commit", commit))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, name
            assert grpc_caller.lookup(ns, key) == 0, f"{name}: nothing published"
        socket_caller.close()
        grpc_caller.close()
    finally:
        server.stop(grace_s=1)
