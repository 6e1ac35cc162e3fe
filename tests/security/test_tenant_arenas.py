"""Per-tenant arenas (DESIGN §11): tenants A and B on one real server (TLS, tokens) each
move pages through their own shared-memory arena, handed over as a file descriptor by the
arena socket to the caller's own token; B can neither obtain nor use A's; a page A scribbles
on in its own arena is quarantined, never sent or demoted; a client that dies mid-put and a
server restart leave nothing behind."""

from __future__ import annotations

import json
import mmap
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.certs import CertAuthority
from support.kv import random_kv
from support.tenants import (
    LAYOUT,
    PAGE_BYTES,
    READER,
    A,
    B,
    Caller,
    map_own_arena,
    new_keys,
    new_ns,
    tenant_config,
    tenant_grants,
)

from kvstore._proto import data_pb2
from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.client import ClientTLS, KVStoreClient
from kvstore.errors import Unauthenticated
from kvstore.page import ARENA_MAGIC, checksum
from kvstore.security.arena_socket import receive_arena
from kvstore.server import Server
from kvstore.tiers.arenas import ARENA_BITS
from kvstore.types import Namespace

pytest_plugins = ["support.tenants"]


def _arena_token(mapping) -> bytes:  # type: ignore[no-untyped-def]
    return bytes(mapping[len(ARENA_MAGIC) : len(ARENA_MAGIC) + 16])


def _client_offset(server: Server, key: bytes) -> int:
    """Where a stored page lies in the arena its owner's clients map (read from the server)."""
    slot = server.core.where(key)["host"]
    return server.core.landing.at(slot).offset(slot)


async def test_both_tenants_put_and_get_through_their_own_arenas(tenant_server, ca, layout) -> None:
    tls = ClientTLS(ca=ca.cert)
    tokens = list(range(8 * layout.page_tokens))
    kv_a, kv_b = random_kv(layout, len(tokens), seed=1), random_kv(layout, len(tokens), seed=2)
    ns = Namespace("m", "r1", layout)
    async with KVStoreClient(tenant_server.address, ns, token=A, tls=tls) as alice, \
            KVStoreClient(tenant_server.address, ns, token=B, tls=tls) as bob:
        assert alice.shared_memory and bob.shared_memory, "both map their own arena"
        assert await alice.put(tokens, kv_a) == len(tokens)
        assert await bob.put(tokens, kv_b) == len(tokens)
        for client, kv in ((alice, kv_a), (bob, kv_b)):
            hit = await client.lookup(tokens)
            out = torch.zeros_like(kv)
            assert await client.get(hit, into=out) == len(tokens)
            assert torch.equal(out, kv), "bit-exact through the arena"
        slots_a = {tenant_server.core.where(k)["host"] >> ARENA_BITS for k in (await alice.lookup(tokens)).keys}
        slots_b = {tenant_server.core.where(k)["host"] >> ARENA_BITS for k in (await bob.lookup(tokens)).keys}
        assert len(slots_a) == len(slots_b) == 1 and slots_a != slots_b, "each tenant's pages are in its own arena"
    assert not list(tenant_server.config.host.shm_dir.glob(f"kvstore-{tenant_server.config.node}-{os.getpid()}-*")), \
        "no arena has a name in /dev/shm"


def test_the_socket_hands_each_token_its_own_arena_and_nothing_else(tenant_server, ca) -> None:
    a, b = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B)
    info_a, info_b = (c(c.data.GetInfo, data_pb2.GetInfoRequest()) for c in (a, b))
    with map_own_arena(tenant_server, A) as arena_a, map_own_arena(tenant_server, B) as arena_b, \
            map_own_arena(tenant_server, READER) as arena_reader:
        assert _arena_token(arena_a) == info_a.arena_token == _arena_token(arena_reader), "a token of tenant a: a's arena"
        assert _arena_token(arena_b) == info_b.arena_token != info_a.arena_token
        assert len(arena_b) == info_b.arena_bytes
    for token in (None, "not-a-token-0123456789abcdef", A + "x"):
        with pytest.raises(Unauthenticated):
            map_own_arena(tenant_server, token)


async def test_a_read_only_token_receives_its_arena_read_only(tenant_server, ca, layout) -> None:
    """Bug: a token with only the read right received its tenant's arena read-write: it could
    map it writable and overwrite the pages its tenant's other clients read through shared
    memory. Now its descriptor is read-only (a writable mapping is refused by the kernel), its
    client maps it read-only and still reads bit-exact; a read-write token is unchanged."""
    assert tenant_server.arena_socket is not None
    fd, size, tenant = receive_arena(tenant_server.arena_socket.path, READER)
    try:
        assert tenant == "a"
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        with pytest.raises(OSError):
            os.pwrite(fd, b"x", 4096)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as view:
            assert view[: len(ARENA_MAGIC)] == ARENA_MAGIC
    finally:
        os.close(fd)
    fd, size, _ = receive_arena(tenant_server.arena_socket.path, A)
    try:
        mmap.mmap(fd, size, flags=mmap.MAP_SHARED).close()  # the writer's stays writable
    finally:
        os.close(fd)
    tls = ClientTLS(ca=ca.cert)
    tokens = list(range(4 * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=3)
    ns = Namespace("m", "r1", layout)
    async with KVStoreClient(tenant_server.address, ns, token=A, tls=tls) as writer, \
            KVStoreClient(tenant_server.address, ns, token=READER, tls=tls) as reader:
        assert writer.shared_memory and reader.shared_memory, "the reader reads through its (read-only) arena"
        assert await writer.put(tokens, kv) == len(tokens)
        hit = await reader.lookup(tokens)
        out = torch.zeros_like(kv)
        assert await reader.get(hit, into=out) == len(tokens)
        assert torch.equal(out, kv), "bit-exact through the read-only mapping"


def test_a_slot_offset_of_a_is_meaningless_in_bs_arena(tenant_server, ca) -> None:
    """B learns the offset of A's page (the worst case): at that offset its own arena holds
    nothing of A's, and it cannot commit or read A's allocation through it."""
    a, b = Caller(tenant_server, ca, A), Caller(tenant_server, ca, B)
    ns, [key] = new_ns(), new_keys(1)
    secret = secrets.token_bytes(PAGE_BYTES)
    alloc = a(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=[key]))
    offset = alloc.slots[0].offset
    with map_own_arena(tenant_server, A) as arena_a:
        arena_a[offset : offset + PAGE_BYTES] = secret
    assert a(a.data.Commit, data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=[key],
                                                   checksums=[checksum(secret)])).num_published == 1
    with map_own_arena(tenant_server, B) as arena_b:
        assert arena_b[offset : offset + PAGE_BYTES] != secret
        assert secret not in arena_b[:]
    assert b.code(b.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=[key])).name == "OK"
    assert b(b.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=[key])).pages == []


def _scribble(server: Server, token: str, key: bytes) -> None:
    """A tenant writes over one byte of its own page in its own mapped arena."""
    offset = _client_offset(server, key) + 9
    with map_own_arena(server, token) as arena:
        arena[offset] ^= 0xFF


def test_a_page_scribbled_on_is_quarantined_not_sent(tenant_server, ca) -> None:
    a = Caller(tenant_server, ca, A)
    ns, keys = new_ns(), new_keys(3)
    assert a.put(ns, keys) == 3
    _scribble(tenant_server, A, keys[1])
    pages = a.stream(a.data.ReadPages, data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys))
    assert [p.key for p in pages] == keys[:1]
    assert keys[1] in [q.key for q in tenant_server.core.quarantined()]
    assert a.lookup(ns, keys) == 1


def test_a_page_scribbled_on_is_quarantined_not_demoted(tmp_path: Path, ca: CertAuthority) -> None:
    """The tenant's arena is small (8 MiB): filling it evicts its coldest page,
    the scribbled one, which is checked before it is written to SSD."""
    server = Server(tenant_config(tmp_path, ca, host_bytes=8 << 20))
    server.start()
    try:
        a = Caller(server, ca, A)
        ns, [victim] = new_ns(), new_keys(1)
        assert a.put(ns, [victim]) == 1
        _scribble(server, A, victim)
        for _ in range(3):  # the 8 MiB arena holds 2048 slots of 4 KiB
            assert a.put(ns, new_keys(1000)) == 1000
        assert victim in [q.key for q in server.core.quarantined()]
        assert "ssd" not in server.core.where(victim) and a.lookup(ns, [victim]) == 0
    finally:
        server.stop(grace_s=1)


def test_each_arena_has_its_tenants_host_quota_and_evicts_only_its_own_pages(tmp_path: Path, ca: CertAuthority) -> None:
    """A's arena is its host_bytes quota (8 MiB: 2048 slots of 4 KiB); B, without a quota of
    its own, has --host-capacity. A storing far more than its arena holds evicts (writes
    down) A's coldest pages, in A's arena only: B's pages all stay in RAM."""
    config = tenant_config(tmp_path, ca)
    config.security.auth_file.write_text(json.dumps({"tokens": tenant_grants(), "quotas": {"a": {"host_bytes": "8MiB"}}}))
    server = Server(config)
    server.start()
    try:
        a, b = Caller(server, ca, A), Caller(server, ca, B)
        info_a, info_b = (c(c.data.GetInfo, data_pb2.GetInfoRequest()) for c in (a, b))
        assert info_a.arena_bytes == (8 << 20) + 4096 and info_b.arena_bytes == config.host.capacity_bytes + 4096
        ns_a, ns_b, keys_b = new_ns(), new_ns(), new_keys(50)
        assert b.put(ns_b, keys_b) == 50
        for _ in range(3):
            assert a.put(ns_a, new_keys(1000)) == 1000
        assert server.core.landing.part("a").usage().used_bytes <= 8 << 20
        assert all("host" in server.core.where(k) for k in keys_b), "B's pages were not evicted for A's"
        assert server.metrics.evictions.labels("host")._value.get() > 0
    finally:
        server.stop(grace_s=1)


CHILD = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
sys.path[:0] = sys.argv[1:3]
from support.tenants import LAYOUT, Caller, map_own_arena, new_keys
from kvstore._proto import data_pb2
address, socket, ca, token, ns = sys.argv[3:]
server = SimpleNamespace(address=address, arena_socket=SimpleNamespace(path=Path(socket)))
a = Caller(server, SimpleNamespace(cert=Path(ca)), token)
alloc = a(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=bytes.fromhex(ns), layout=LAYOUT, keys=new_keys(8)))
arena = map_own_arena(server, token)
arena[alloc.slots[0].offset : alloc.slots[0].offset + 100] = b"x" * 100  # half a put: written, never committed
print("allocated", flush=True)
time.sleep(60)
"""


def test_nothing_is_left_behind_when_a_client_dies_mid_put(tmp_path: Path, ca: CertAuthority) -> None:
    server = Server(tenant_config(tmp_path, ca, allocation_ttl_ms=300))
    server.start()
    try:
        here = Path(__file__).parent
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(here), str(here.parent), server.address,
                                  str(server.arena_socket.path), str(ca.cert), A, new_ns().hex()],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "allocated", child.stderr.read()
            assert server.core.view().num_allocations == 1
            assert server.core.arena_of("a").size_bytes and server.core.landing.part("a").usage().used_bytes > 0
        finally:
            child.kill()
            child.wait(KILL_WAIT_S)
        deadline = time.monotonic() + 10
        while server.core.view().num_allocations and time.monotonic() < deadline:  # the allocation expires by its TTL
            server.core.stats()  # reaps what expired
            time.sleep(0.05)
        assert server.core.view().num_allocations == 0
        assert server.core.landing.part("a").usage().used_bytes == 0, "its slots are free again"
    finally:
        server.stop(grace_s=1)


async def test_a_restarted_server_hands_out_new_arenas_and_reads_pages_back(tmp_path: Path, ca: CertAuthority, layout) -> None:
    tls = ClientTLS(ca=ca.cert)
    tokens = list(range(4 * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=5)
    ns = Namespace("m", "r1", layout)
    config = tenant_config(tmp_path, ca)
    server = Server(config)
    server.start()
    try:
        async with KVStoreClient(server.address, ns, token=A, tls=tls) as alice:
            assert alice.shared_memory
            assert await alice.put(tokens, kv, durable=True) == len(tokens)
        old_token = server.core.arena_of("a").token
    finally:
        server.stop(grace_s=1)
    assert not server.arena_socket.path.exists(), "the socket goes with the server"
    server = Server(config)
    server.start()
    try:
        async with KVStoreClient(server.address, ns, token=A, tls=tls) as alice:
            assert alice.shared_memory
            assert server.core.arena_of("a").token != old_token, "a new arena"
            hit = await alice.lookup(tokens)
            out = torch.zeros_like(kv)
            assert await alice.get(hit, into=out) == len(tokens)
            assert torch.equal(out, kv), "read up from SSD into the tenant's new arena"
    finally:
        server.stop(grace_s=1)


def test_a_lookup_by_another_tenants_admin_is_refused_clearly(tenant_server, ca) -> None:
    """An admin may read any namespace, but its pages are in their owner's arena, which the
    admin does not map: Acquire says so (ReadPages serves them)."""
    from support.tenants import OPS

    a, ops = Caller(tenant_server, ca, A), Caller(tenant_server, ca, OPS)
    ns, keys = new_ns(), new_keys(2)
    assert a.put(ns, keys) == 2
    assert ops.code(ops.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys)).name == "INVALID_ARGUMENT"
    assert len(ops.stream(ops.data.ReadPages, data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys))) == 2
    assert ops.lookup(ns, keys) == 2


ATTACK = """
import os, sys
pid = sys.argv[1]
try:
    names = os.listdir(f"/proc/{pid}/fd")
except PermissionError:
    names = []
for name in names:
    try:
        fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY)
    except OSError:
        continue
    print("opened", os.readlink(f"/proc/self/fd/{fd}"))
print("done")
"""


HOLDER = "import os, time; os.memfd_create('kvstore-test-arena'); print('holding', flush=True); time.sleep(60)"


def test_a_same_uid_process_cannot_open_the_servers_arena_descriptors(tmp_path: Path, ca: CertAuthority) -> None:
    """A tenant's arena has no path; the one route left to a process of the server's uid,
    /proc/<server>/fd/N, is closed: kvstore-server makes itself undumpable when it has
    tenants. The same attack on an ordinary process holding a memfd succeeds (the control).
    Server, holder and attacker run without capabilities (as root: under ``setpriv`` with an
    empty bounding set), as processes of one unprivileged uid do; root with CAP_SYS_PTRACE
    still gets in (see README)."""
    from support.secure_server import write_auth_file
    from support.servers import ServerProcess

    unprivileged = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else []
    auth, issued = write_auth_file(tmp_path / "auth.json", tenant_grants()), ca.server_cert()
    server = ServerProcess(tmp_path, "--auth-file", str(auth), "--tls-cert", str(issued.cert), "--tls-key", str(issued.key))
    server.args = [*unprivileged, *server.args]
    holder = subprocess.Popen([*unprivileged, sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    server.start()
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        a = Caller(server, ca, A)  # type: ignore[arg-type]
        assert a(a.data.GetInfo, data_pb2.GetInfoRequest()).arena_socket, "a's arena exists now"
        a.close()

        def attack(pid: int) -> str:
            return subprocess.run([*unprivileged, sys.executable, "-c", ATTACK, str(pid)], capture_output=True, text=True,
                                  timeout=60, check=True).stdout

        assert "opened /memfd:kvstore-test-arena" in attack(holder.pid), "the control: a dumpable process's memfd opens"
        assert attack(server.proc.pid) == "done\n", "the server's descriptors do not"  # type: ignore[union-attr]
    finally:
        server.kill()
        holder.kill()
        holder.wait(KILL_WAIT_S)
