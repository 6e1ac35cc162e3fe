"""Authentication comes before anything else on every RPC (DESIGN §11): every method of every
service (from the descriptors), called with no token, malformed ones and an unknown one, each
with a valid, an undecodable and an over-the-limit request, is answered UNAUTHENTICATED, and
leaves nothing behind: no pin, allocation, lease, binding, marker or stream slot. The same on
the same-host call socket, whose first frame must be a HELLO with a valid token.

Why: `kvstore-bench fuzz` found a request larger than gRPC's receive limit answered
RESOURCE_EXHAUSTED to a caller with a malformed token: the size was checked before the caller.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from support.callsock import read_answer
from support.certs import CertAuthority
from support.secure_server import call_raw, every_method, tls_channel
from support.tenants import LAYOUT, OPS, PAGE_BYTES, A, Caller, new_keys, new_ns, tenant_config

from kvstore._proto import data_pb2, directory_pb2
from kvstore.callsocket import frames
from kvstore.server import Server
from kvstore.server.services.sizes import receive_limit

pytest_plugins = ["support.tenants"]  # its ca fixture

METHODS = list(every_method())
WRONG = "tenant-x-token-0123456789abcdef"  # well-formed, in no auth file
MALFORMED: list[tuple[str, str]] = [  # metadata that carries no usable token
    ("authorization", "Bearer"), ("authorization", "Basic dXNlcjpwYXNzd29yZA=="), ("authorization", A),
    ("authorization", f"Bearer {A[:-1]}"), ("authorization", "Bearer " + "A" * 4000), ("x-api-key", A)]
CALLERS: list[tuple[str, list[tuple[str, str]]]] = [
    ("no-token", []), *((f"malformed-{i}", [m]) for i, m in enumerate(MALFORMED)), ("wrong-token", [("authorization", f"Bearer {WRONG}")])]


class Setup:
    """A's namespace (pages, a session) on one server; valid requests name A's real ids."""

    def __init__(self, server: Server, ca: CertAuthority) -> None:
        self.server, self.ca = server, ca
        self.a = Caller(server, ca, A)
        self.ns, self.keys = new_ns(), new_keys(4)
        assert self.a.put(self.ns, self.keys) == 4
        self.a(self.a.data.AppendTokens, data_pb2.AppendTokensRequest(namespace_id=self.ns, session_id="s", tokens=[7, 8, 9]))
        self.huge = receive_limit(server.config) + 1  # over every method's bound: gRPC itself refuses it unread

    def valid(self, message: Message, depth: int = 0) -> None:
        """Fills ``message`` (a request) with A's real ids and plausible scalars."""
        for f in message.DESCRIPTOR.fields:
            if f.message_type is not None:
                if f.message_type.GetOptions().map_entry:
                    continue
                if f.message_type.name == "Layout" and not f.is_repeated:
                    getattr(message, f.name).CopyFrom(LAYOUT)
                elif depth < 2:
                    self.valid(getattr(message, f.name).add() if f.is_repeated else getattr(message, f.name), depth + 1)
            elif f.is_repeated:
                getattr(message, f.name).extend(self.keys if f.name == "keys" else [self._scalar(f)])
            else:
                setattr(message, f.name, self._scalar(f))

    def _scalar(self, f: FieldDescriptor) -> object:
        if f.type == f.TYPE_BYTES:
            return {"namespace_id": self.ns, "key": self.keys[0], "parent": self.keys[0]}.get(f.name, b"\x01" * 16)
        if f.type == f.TYPE_STRING:
            return {"session_id": "s", "tier": "host", "tenant": "", "holder": ""}.get(f.name, "x")  # no node-only calls
        if f.type == f.TYPE_BOOL:
            return False
        if f.type == f.TYPE_ENUM:
            return f.enum_type.values[-1].number
        if f.type in (f.TYPE_FLOAT, f.TYPE_DOUBLE):
            return 1.0
        return PAGE_BYTES if f.name == "page_bytes" else 1

    def bodies(self, method: MethodDescriptor) -> dict[str, bytes]:
        request = message_factory.GetMessageClass(method.input_type)()
        self.valid(request)
        return {"valid": request.SerializeToString(), "undecodable": b"\xff" * 64, "huge": b"\x00" * self.huge}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, ca: CertAuthority) -> Iterator[Setup]:
    server = Server(tenant_config(tmp_path_factory.mktemp("server"), ca))
    server.start()
    s = Setup(server, ca)
    yield s
    s.a.close()
    server.stop(grace_s=1)


def test_the_valid_bodies_are_valid(setup: Setup) -> None:
    """Guards the filler: with A's token a valid Lookup finds A's pages, so a refused valid
    call would have acted had it been let through."""
    [(service, method)] = [(s, m) for s, m in METHODS if m.name == "Lookup"]
    found = directory_pb2.LookupResponse.FromString(setup.a.channel.unary_unary(f"/{service.full_name}/Lookup")(
        setup.bodies(method)["valid"], metadata=setup.a.metadata, timeout=10))
    assert found.num_pages == 4


def test_every_rpc_refuses_an_unauthenticated_caller_before_anything_else(setup: Setup) -> None:
    errors = setup.server.metrics.rpc_errors
    wrong: list[str] = []
    with tls_channel(setup.server.address, setup.ca) as channel:
        for service, method in METHODS:
            before = errors.labels(method.name, "UNAUTHENTICATED")._value.get()
            calls = 0
            for body_name, body in setup.bodies(method).items():
                for caller, metadata in CALLERS:
                    code = call_raw(channel, service, method, body=body, metadata=metadata)
                    calls += 1
                    if code != grpc.StatusCode.UNAUTHENTICATED:
                        wrong.append(f"{service.name}.{method.name} {body_name} body, {caller}: {code.name}")
            counted = errors.labels(method.name, "UNAUTHENTICATED")._value.get() - before
            if counted != calls:  # every refusal is the interceptor's: a method that got further is not counted so
                wrong.append(f"{service.name}.{method.name}: {counted} of {calls} refusals counted")
    assert not wrong, "\n".join(wrong)
    _assert_nothing_held(setup)


def _assert_nothing_held(setup: Setup) -> None:
    server = setup.server
    counts = server.core.leases.counts()
    assert (counts.num_leases, counts.num_allocations, counts.pinned) == (0, 0, frozenset())
    assert server.streams.num_open == 0
    assert server.tenancy.owners.tenants() == ["a"] and server.tenancy.owners.namespaces_of("a") == {setup.ns}
    assert len(server.handoffs) == 0 and server.session_owners.items() == []
    assert setup.a.lookup(setup.ns, setup.keys) == 4, "A's pages are all there"
    stats = Caller(server, setup.ca, OPS)
    try:
        answer = stats(stats.directory.Stats, directory_pb2.StatsRequest())
    finally:
        stats.close()
    assert answer.num_leases == 0
    for usage in answer.tenants:
        held = {k: v for k, v in usage.used.items() if k in ("leases", "allocations", "hints", "call_connections") and v}
        assert not held, (usage.tenant, held)


@pytest.mark.parametrize("first", ["no-hello", "hello"])
def test_the_call_socket_refuses_an_unauthenticated_caller_before_anything_else(setup: Setup, first: str) -> None:
    """Every method the call socket serves, as the first frame (no HELLO) or after a HELLO with
    a bad token, with each body: UNAUTHENTICATED, the connection closed, nothing held."""
    tokens: list[bytes] = [b"", b"Bearer " + A.encode(), A[:-1].encode(), b"\xff\xfe", b"A" * 5000, WRONG.encode()]
    wrong: list[str] = []
    for name in frames.METHODS:
        [method] = [m for s, m in METHODS if f"{s.name}.{m.name}" == name]
        for body_name, body in setup.bodies(method).items():
            body = body[: frames.MAX_REQUEST_BYTES + 1] if body_name == "huge" else body
            for token in tokens if first == "hello" else [None]:
                sent = b"" if token is None else frames.request_frame(frames.HELLO, 0, token)
                sent += frames.request_frame(frames.METHOD_IDS[name], 10_000, body)
                answers = _send_raw(setup.server, sent)
                if [code for code, _ in answers] != [grpc.StatusCode.UNAUTHENTICATED]:
                    wrong.append(f"{name} {body_name} body, {first} {token!r:.20}: {[(c.name, b[:80]) for c, b in answers]}")
    assert not wrong, "\n".join(wrong)
    _assert_nothing_held(setup)
    assert all(setup.server.call_socket.tenant_connections(t) == 0 for t in ("a", "b", "ops"))


def _send_raw(server: Server, frames: bytes) -> list[tuple[grpc.StatusCode, bytes]]:
    """Every answer the call socket gives to ``frames`` before it closes the connection."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(server.call_socket.path))
    try:
        try:
            sock.sendall(frames)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused part way: the answer is there to read
        answers = []
        while (answer := read_answer(sock)) is not None:
            answers.append(answer)
        return answers
    finally:
        sock.close()
