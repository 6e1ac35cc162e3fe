"""--local-socket: a Unix socket for clients on the server's own host. TLS protects what
crosses a network; on a 0600 Unix socket nothing does, so it carries no TLS (the cost the
soak bench measured on the same-host path), but every call on it is authenticated and
confined to its tenant exactly as on the TLS port."""

from __future__ import annotations

import dataclasses
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from support.kv import random_kv
from support.secure_server import call_raw, every_method
from support.servers import ServerProcess
from support.tenants import A, B, tenant_config

from kvstore.client import KVStoreClient
from kvstore.security.channel import sync_channel
from kvstore.server import Server
from kvstore.types import Namespace

pytest_plugins = ["support.tenants"]


@pytest.fixture
def local_server(tmp_path: Path, ca) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    short = Path(tempfile.mkdtemp(prefix="kvs-"))  # a Unix socket path has at most 107 bytes
    config = tenant_config(tmp_path, ca)
    config = dataclasses.replace(config, security=dataclasses.replace(config.security, local_socket=short / "kv.sock"))
    server = Server(config)
    server.start()
    yield server
    server.stop(grace_s=1)
    short.rmdir()  # fails if the server left its socket behind


def _address(server: Server) -> str:
    return f"unix:{server.config.security.local_socket}"


def test_the_socket_is_private_to_the_servers_uid(local_server: Server) -> None:
    path = local_server.config.security.local_socket
    assert path is not None and stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


async def test_a_token_works_over_it_without_tls_and_tenants_stay_apart(local_server: Server, layout) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(4 * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=3)
    ns = Namespace("m", "r1", layout)
    async with KVStoreClient(_address(local_server), ns, token=A) as alice, \
            KVStoreClient(_address(local_server), ns, token=B) as bob:
        assert alice.shared_memory, "a same-host client maps its tenant's arena, as over TLS"
        assert await alice.put(tokens, kv) == len(tokens)
        hit = await alice.lookup(tokens)
        out = torch.zeros_like(kv)
        assert await alice.get(hit, into=out) == len(tokens) and torch.equal(out, kv)
        assert (await bob.lookup(tokens)).num_tokens == 0, "B's namespace ids are its own: A's pages are not found"


def test_every_rpc_on_it_needs_a_valid_token(local_server: Server) -> None:
    with sync_channel(_address(local_server)) as channel:
        for service, method in every_method():
            assert call_raw(channel, service, method) == grpc.StatusCode.UNAUTHENTICATED, method.full_name
            assert call_raw(channel, service, method, token="not-a-token-of-anyone") == grpc.StatusCode.UNAUTHENTICATED


def test_a_killed_servers_socket_is_replaced_and_a_regular_file_refused(tmp_path: Path) -> None:
    """kvstore-server SIGKILLed leaves its socket file; the next one on that data directory
    binds anew (it holds the directory's lock, so no live server uses the file); a path that
    is not a socket is never deleted: the server refuses to start."""
    short = Path(tempfile.mkdtemp(prefix="kvs-"))
    path = short / "kv.sock"
    server = ServerProcess(tmp_path, "--tiers", "host", "--local-socket", str(path))
    try:
        server.start()
        server.kill()
        assert path.is_socket(), "SIGKILL leaves the file"
        server.start()
        with sync_channel(f"unix:{path}") as channel:
            assert call_raw(channel, *_get_info()) == grpc.StatusCode.OK, "the new server answers on it"
        assert server.terminate() == 0
        assert not path.exists(), "a stopped server removes its socket"
        path.write_text("not a socket")
        with pytest.raises(RuntimeError, match="not a socket"):
            server.start()
        assert path.read_text() == "not a socket"
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
        for p in short.iterdir():
            p.unlink()
        short.rmdir()


def _get_info():  # type: ignore[no-untyped-def]
    return next((s, m) for s, m in every_method() if m.name == "GetInfo")
