"""Two tenants (and an operator) on one real server with TLS and tokens: the auth file, a
raw caller that sends any request as any token, and page writes made the way a client does."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import mmap
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.page import checksum
from kvstore.security.arena_socket import receive_arena
from kvstore.server import Server
from support.certs import CertAuthority
from support.secure_server import secure_config, tls_channel, write_auth_file
from support.servers import flip_ssd_byte

A = "tenant-a-token-0123456789abcdef"  # tenant a: read, write
B = "tenant-b-token-0123456789abcdef"  # tenant b: read, write
OPS = "tenant-ops-token-0123456789abcd"  # tenant ops: read, write, admin
READER = "tenant-a-reader-0123456789abcd"  # tenant a: read only
WRITER = "tenant-a-writer-0123456789abcd"  # tenant a: write only
NODE = "cluster-node-token-0123456789ab"  # a cluster node: the node right only
LAYOUT = common_pb2.Layout(num_layers=2, kv_factor=2, num_kv_heads=1, head_dim=8, dtype="float32", page_tokens=4)
PAGE_BYTES = 2 * 2 * 1 * 8 * 4 * 4  # of LAYOUT


def tenant_grants(extra: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [
        {"tenant": "a", "rights": ["read", "write"], "token": A},
        {"tenant": "b", "rights": ["read", "write"], "token": B},
        {"tenant": "ops", "rights": ["read", "write", "admin"], "token": OPS},
        {"tenant": "a", "rights": ["read"], "token": READER},
        {"tenant": "a", "rights": ["write"], "token": WRITER},
        {"tenant": "cluster", "rights": ["node"], "token": NODE},
        *(extra or []),
    ]


def tenant_config(tmp: Path, ca: CertAuthority, grants: list[dict[str, Any]] | None = None, **kw: Any) -> ServerConfig:
    auth = write_auth_file(tmp / "auth.json", grants or tenant_grants())
    return secure_config(tmp, auth_file=auth, tls=ca.server_cert(), **kw)


def start_with_quotas(tmp: Path, ca: CertAuthority, quotas: dict[str, Any], share_arena: bool = False) -> Server:
    """A started tenant server whose auth file gives the tenants ``quotas`` ([quotas.TENANT])."""
    config = tenant_config(tmp, ca)
    if share_arena:
        config = dataclasses.replace(config, security=dataclasses.replace(config.security, share_arena=True))
    assert config.security.auth_file is not None
    config.security.auth_file.write_text(json.dumps({"tokens": tenant_grants(), "quotas": quotas}))
    server = Server(config)
    server.start()
    return server


def new_ns() -> bytes:
    return secrets.token_bytes(16)


def new_keys(n: int) -> list[bytes]:
    return [secrets.token_bytes(16) for _ in range(n)]


class Caller:
    """Raw stubs over one TLS channel, every call made with ``token`` (None: none)."""

    def __init__(self, server: Server, ca: CertAuthority, token: str | None) -> None:
        self.channel = tls_channel(server.address, ca)
        self.metadata = [("authorization", f"Bearer {token}")] if token is not None else None
        self.data = data_pb2_grpc.DataStub(self.channel)
        self.directory = directory_pb2_grpc.DirectoryStub(self.channel)

    def __call__(self, method: Any, request: Any, timeout: float = 10.0) -> Any:
        return method(request, metadata=self.metadata, timeout=timeout)

    def stream(self, method: Any, request: Any, timeout: float = 10.0) -> list[Any]:
        return list(method(request, metadata=self.metadata, timeout=timeout))

    def code(self, method: Any, request: Any) -> grpc.StatusCode:
        """The status of a unary call (OK when it succeeded)."""
        try:
            self(method, request)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def put(self, ns: bytes, keys: list[bytes], durable: bool = False) -> int:
        """Stores pages as a remote client does (WritePages); returns num_published."""
        chunks = []
        for key in keys:
            data = secrets.token_bytes(PAGE_BYTES)
            chunks.append(data_pb2.PageChunk(key=key, namespace_id=ns, layout=LAYOUT, page_bytes=PAGE_BYTES,
                                             checksum=checksum(data), offset=0, data=data, durable=durable))
        return self.data.WritePages(iter(chunks), metadata=self.metadata, timeout=10).num_published

    def lookup(self, ns: bytes, keys: list[bytes]) -> int:
        return self(self.directory.Lookup, directory_pb2.LookupRequest(namespace_id=ns, keys=keys)).num_pages

    def close(self) -> None:
        self.channel.close()


def quarantine_a_page(server: Server, owner: Caller, ns: bytes) -> bytes:
    """Stores a page of ``owner`` on SSD only, damages it there and reads it: the server
    quarantines it. Returns its key."""
    [key] = new_keys(1)
    assert owner.put(ns, [key], durable=True) == 1
    owner(owner.directory.Remove, directory_pb2.RemoveRequest(namespace_id=ns, keys=[key], tier="host"))
    flip_ssd_byte(server, key, where=7)
    assert owner.stream(owner.data.ReadPages, data_pb2.ReadPagesRequest(namespace_id=ns, keys=[key])) == []
    assert [q.key for q in server.core.quarantined()][-1:] == [key]
    return key


def map_own_arena(server: Server, token: str | None) -> mmap.mmap:
    """The arena the server's arena socket hands to ``token``, mapped as a same-host client
    maps it: read-only for a token without the write right (the caller closes it)."""
    assert server.arena_socket is not None
    fd, size, _ = receive_arena(server.arena_socket.path, token)
    try:
        read_only = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        return mmap.mmap(fd, size, prot=mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


@dataclass
class World:
    """The hostile-tenant suites' server (over gRPC: test_hostile_tenant.py, over the call
    socket: test_call_socket_tenants.py): B knows all of A's ids and attacks them."""

    server: Server
    a: Caller  # over gRPC (TLS)
    b: Any  # a Caller (gRPC) or a callsock.SocketCaller (the call socket)
    ns: bytes  # A's namespace, holding A's pages ``keys`` and A's session "s"
    keys: list[bytes]


def hostile_world(tmp: Path, ca: CertAuthority, b_of: Callable[[Server], Any]) -> Iterator[World]:
    """A module's World (a yield fixture's body): A's namespace set up, B made by ``b_of``."""
    server = Server(tenant_config(tmp, ca))
    server.start()
    a = Caller(server, ca, A)
    ns, keys = new_ns(), new_keys(4)
    assert a.put(ns, keys) == 4
    a(a.data.AppendTokens, data_pb2.AppendTokensRequest(namespace_id=ns, session_id="s", tokens=[7, 8, 9], prompt_tokens=2))
    b = b_of(server)
    yield World(server, a, b, ns, keys)
    b.close()
    a.close()
    server.stop(grace_s=1)


def assert_a_intact(w: World) -> None:
    """After each attack: A's pages, session and namespace are as ``hostile_world`` left them."""
    assert w.a.lookup(w.ns, w.keys) == 4, "A's pages must survive B's attack"
    session = w.a(w.a.data.GetSession, data_pb2.GetSessionRequest(namespace_id=w.ns, session_id="s"))
    assert (session.found, list(session.tokens)) == (True, [7, 8, 9])
    assert w.server.tenancy.owners.owner(w.ns) == "a"


def callers(server: Server, ca: CertAuthority, *tokens: str | None) -> Iterator[Caller]:
    for token in tokens:
        yield Caller(server, ca, token)


# Fixtures of the files that name this module in pytest_plugins.
@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertAuthority:
    return CertAuthority(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def tenant_server(tmp_path: Path, ca: CertAuthority) -> Iterator[Server]:
    server = Server(tenant_config(tmp_path, ca))
    server.start()
    yield server
    server.stop(grace_s=1)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, ca: CertAuthority) -> Iterator[World]:
    """One server per module for the hostile-tenant suites; B calls over TLS with its token (a
    module may define its own, e.g. B over the call socket). Every test attacks A's namespace as it
    was set up there, and ``a_is_intact`` checks it is whole afterwards."""
    yield from hostile_world(tmp_path_factory.mktemp("server"), ca, lambda server: Caller(server, ca, B))


@pytest.fixture(autouse=True)
def a_is_intact(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "world" in request.fixturenames:
        assert_a_intact(request.getfixturevalue("world"))
