"""hbm pools follow the host arenas' trust model (DESIGN §6): one pool per tenant,
handed by the arena socket only to that tenant's tokens, filled only with the pages its own
engines asked to read on their device. Tenants A and B on one real server (TLS, tokens),
the pools emulated in host memory (the device seam's CPU implementation), mapped exactly as
an engine maps its own."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.certs import CertAuthority
from support.kv import random_kv
from support.tenants import OPS, READER, WRITER, A, B, Caller, new_keys, new_ns, tenant_config

from kvstore._proto import data_pb2
from kvstore.client import ClientTLS, KVStoreClient
from kvstore.config import HbmTierConfig
from kvstore.device_ops import CpuOps, PoolHandout, host_address
from kvstore.errors import KVStoreError, Unauthenticated
from kvstore.security.arena_socket import _exchange, receive_arena, receive_pool
from kvstore.server import Server
from kvstore.types import Namespace

pytest_plugins = ["support.tenants"]

POOL_BYTES = 2 << 20


@pytest.fixture
def pool_server(tmp_path: Path, ca: CertAuthority) -> Iterator[Server]:
    config = dataclasses.replace(tenant_config(tmp_path, ca), tiers=("hbm", "host", "ssd"),
                                 hbm=HbmTierConfig(capacity_bytes=POOL_BYTES, slab_bytes=1 << 20, device="cpu"))
    server = Server(config)
    server.start()
    yield server
    server.stop(grace_s=1)


def _pinned(server: Server) -> tuple[CpuOps, dict[int, int]]:
    """The seam's record of what is pinned, and what should be: every arena, whole."""
    ops = server.core.landing.pins.ops
    assert isinstance(ops, CpuOps)
    return ops, {host_address(part.memory()): len(part.memory()) for part in server.core.landing.parts()}


def _pool(server: Server, token: str | None) -> tuple[PoolHandout, str, bytes]:
    """The pool the socket hands ``token``: its handout, its tenant and all its bytes now."""
    assert server.arena_socket is not None
    handout, tenant = receive_pool(server.arena_socket.path, token)
    try:
        with mmap.mmap(handout.fd, handout.size_bytes, prot=mmap.PROT_READ) as mm:
            return handout, tenant, bytes(mm)
    finally:
        os.close(handout.fd)


def test_the_socket_hands_each_token_its_own_tenants_pool_and_nothing_else(pool_server) -> None:
    pa, tenant_a, _ = _pool(pool_server, A)
    pb, tenant_b, _ = _pool(pool_server, B)
    po, tenant_ops, _ = _pool(pool_server, OPS)  # an admin token: its own tenant's pool, never another's
    assert (tenant_a, tenant_b, tenant_ops) == ("a", "b", "ops")
    assert len({pa.token, pb.token, po.token}) == 3, "one pool per tenant"
    assert pa.token == pool_server.core.pool_of("a").token and pa.size_bytes == POOL_BYTES
    again, _, _ = _pool(pool_server, A)
    assert again.token == pa.token, "a tenant's pool is made once"
    # The request names no tenant: whatever else it says, the token decides.
    assert pool_server.arena_socket is not None
    answer, fd = _exchange(pool_server.arena_socket.path, {"token": A, "want": "pool", "tenant": "b"}, 5.0)
    assert fd is not None
    os.close(fd)
    assert answer["tenant"] == "a" and answer["pool_token"] == pa.token.hex()
    for token in (None, "not-a-token-0123456789abcdef", B + "x"):
        with pytest.raises(Unauthenticated):
            receive_pool(pool_server.arena_socket.path, token)
    for token in (READER, WRITER):  # a pool maps writable: only a token with read and write gets one
        with pytest.raises(KVStoreError, match="read and write"):
            receive_pool(pool_server.arena_socket.path, token)
    fd, _, tenant = receive_arena(pool_server.arena_socket.path, B)  # the arena socket still hands arenas as before
    os.close(fd)
    assert tenant == "b"


async def test_a_tenants_device_load_fills_only_its_own_pool(pool_server, ca, layout) -> None:
    """A's engine loads on its device: A's pages go into A's pool, where its load read them;
    B's pool holds none of A's bytes, and B, asking for A's keys in A's namespace on its
    device, is answered as for an empty namespace and nothing is copied anywhere."""
    tls = ClientTLS(ca=ca.cert)
    tokens = list(range(4 * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=5)
    ns = Namespace("m", "r1", layout)
    async with KVStoreClient(pool_server.address, ns, token=A, tls=tls) as alice:
        await alice.put(tokens, kv)
        hit = await alice.lookup(tokens)
        out = torch.zeros_like(kv)
        load = alice.load(hit, into=out, ahead=1, deadline_s=30, device_ops=CpuOps())
        assert await load.finished() == len(tokens) and torch.equal(out, kv)
        assert load._staged.on_device == [True] * 4  # type: ignore[attr-defined]
    pages = [kv[:, :, i * layout.page_tokens : (i + 1) * layout.page_tokens].contiguous().view(torch.uint8).numpy().tobytes()
             for i in range(4)]
    _, _, in_a = _pool(pool_server, A)
    _, _, in_b = _pool(pool_server, B)
    assert all(page in in_a for page in pages), "A's pages are in A's pool"
    assert in_b.count(0) == len(in_b), "B's pool holds nothing (of A's or anyone's)"

    bob = Caller(pool_server, ca, B)
    try:
        before = pool_server.core.stats().counters["hbm"]["bytes_in"]
        answer = bob(bob.data.Acquire, data_pb2.AcquireRequest(namespace_id=hit.namespace_id, keys=hit.keys, device=True))
        assert not answer.pages and not answer.pool_token, "A's namespace answers B as an empty one"
        assert pool_server.core.stats().counters["hbm"]["bytes_in"] == before, "nothing copied for B"
    finally:
        bob.close()


async def test_every_tenant_arena_is_pinned_as_it_is_made(pool_server, ca, layout) -> None:
    """Bug (found in review): only the one arena of a server without tenants was pinned;
    tenant arenas, made at each tenant's first use long after start, stayed pageable.
    Page-locking is CUDA-only (cudaHostRegister): the decision and the registration are
    checked through the seam's CPU implementation (``CpuOps.pinned``)."""
    server = pool_server
    ops, arenas = _pinned(server)
    try:
        assert ops.pinned == arenas, "no tenant has an arena yet"
        for token in (A, B):  # each tenant's first write makes its arena
            async with KVStoreClient(server.address, Namespace("m", "r", layout), token=token,
                                     tls=ClientTLS(ca=ca.cert)) as client:
                await client.put(list(range(64)), random_kv(layout, 64))
        _, arenas = _pinned(server)
        assert len(arenas) >= 2 and ops.pinned == arenas, "each arena made after start is pinned"
    finally:
        server.stop(grace_s=1)  # the fixture's stop after this one does nothing
    assert ops.pinned == {}, "every arena unpinned before it was unmapped"


def test_a_tenant_whose_pool_the_device_cannot_hold_reads_through_its_arena(pool_server, ca) -> None:
    """The device is out of memory for B's pool: B is refused its pool by name, and its
    Acquire asking for device placement is answered from its arena (nothing promoted)."""
    ops = pool_server.core.promoter.tier.ops
    ops.new_pool = lambda num_bytes, token: (_ for _ in ()).throw(RuntimeError("CUDA out of memory"))  # type: ignore[method-assign]
    assert pool_server.arena_socket is not None
    with pytest.raises(KVStoreError, match="no hbm pool for tenant 'b'"):
        receive_pool(pool_server.arena_socket.path, B)
    bob = Caller(pool_server, ca, B)
    try:
        ns, keys = new_ns(), new_keys(3)
        assert bob.put(ns, keys) == 3
        answer = bob(bob.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys, device=True))
        assert len(answer.pages) == 3 and not answer.pool_token and not any(p.on_device for p in answer.pages)
        assert pool_server.core.stats().counters["hbm"]["bytes_in"] == 0
        bob(bob.data.Release, data_pb2.ReleaseRequest(lease_id=answer.lease_id))
    finally:
        bob.close()


@pytest.mark.parametrize("answer, with_fd", [
    ({"ok": True, "tenant": "a", "size_bytes": 4096, "writable": True, "device": "cpu"}, True),  # no pool_token
    ({"ok": True, "tenant": "a", "size_bytes": 4096, "writable": True, "device": "cuda:0", "pool_token": "00" * 16,
      "handle": "{}"}, True),  # a handle and a descriptor
    ({"ok": True, "tenant": "a", "size_bytes": 4096, "writable": True, "device": "cpu", "pool_token": "00" * 16,
      "handle": ""}, False),  # neither
], ids=["missing-field", "fd-and-handle", "neither"])
def test_a_bad_pool_answer_is_refused_and_its_descriptor_closed(tmp_path: Path, answer: dict, with_fd: bool) -> None:
    """The client side of the exchange, against a peer of this uid that answers wrong."""
    path = tmp_path / "arena.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    sent = os.open("/dev/null", os.O_RDONLY)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(8192)
            body = json.dumps(answer).encode()
            message = struct.pack(">I", len(body)) + body
            socket.send_fds(conn, [message], [sent]) if with_fd else conn.sendall(message)

    server = threading.Thread(target=serve)
    server.start()
    before = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(KVStoreError, match="bad answer|one of them"):
            receive_pool(path, A)
        server.join(5)
        assert len(os.listdir("/proc/self/fd")) <= before, "the descriptor received was closed"
    finally:
        os.close(sent)
        listener.close()
