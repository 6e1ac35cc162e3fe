"""A copy cut at its caller's deadline while a batch's commit runs (DESIGN §11, §12.8): the call
answers, and settles the namespace's binding, only once that commit has ended. What it stored is
then the tenant's, readable by it; nothing stays reserved, pinned or charged beyond what is stored.

Bug pinned here: ``RemoteTier.fetch_from`` commits batch k while batch k+1 arrives; a copy cut
then (``ClusterRuntime.call`` cancels it and returns at once) answered while the commit ran on its
worker thread. When the copy was the namespace's first write at that node (Replicate from a
holder, Migration.Copy), ``settle`` saw nothing held and unbound the namespace; the commit then
stored its pages in an unbound namespace, unreadable by its tenant until it wrote there again.

Two real in-process nodes on a real etcd, the TCP data plane, tenants with tokens. Hooks, not
timing, order it: the first commit at the receiver waits until the copy's task is being cancelled,
and then until the binding is settled (old code) or 0.15 s passed (the call waits on it now)."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.etcd_proc import etcd_fixture, free_port  # noqa: F401  # the fixture
from support.secure_server import secure_config, write_auth_file
from support.tenants import LAYOUT, NODE, PAGE_BYTES, A, tenant_grants

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.config import ClusterConfig
from kvstore.page import checksum
from kvstore.server import Server
from kvstore.server.cluster import remote
from kvstore.server.cluster.remote import RemoteTier
from kvstore.server.tenancy.access import Tenancy
from kvstore.server.tenancy.fetch_room import QuotaLanding

WAIT_S = 30.0  # only a broken hook waits this long
SETTLE_GRACE_S = 0.15  # how long the held commit waits for a settle that may not come before it (the fixed call)
DEADLINE_S = 1.5  # the Replicate call's: the runtime cuts the copy 0.25 s before it


@pytest.fixture
def nodes(etcd: Any, tmp_path: Path) -> Iterator[tuple[Server, Server]]:
    """Holder h and receiver r, one cluster, the tenants' auth file, the node token between them."""
    auth = write_auth_file(tmp_path / "auth.json", tenant_grants())
    started: list[Server] = []
    try:
        for name in ("h", "r"):
            port = free_port()
            cluster = ClusterConfig(etcd=etcd.url, node_id=name, advertise=f"127.0.0.1:{port}", data_plane="tcp", ttl_s=5,
                                    token=NODE)
            config = secure_config(tmp_path / name, auth_file=auth, cluster=cluster, node=name)
            server = Server(replace(config, listen=f"127.0.0.1:{port}"))
            server.start()
            started.append(server)
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop(grace_s=1)


def _written_at(h: Server) -> tuple[bytes, list[bytes], list[bytes]]:
    """Four pages of a new namespace written at h by tenant a, owned by h (r receives no Publish: a copy is its
    first write there): (namespace id, keys, pages)."""
    ns, keys = secrets.token_bytes(16), _owned_by("h", 4)
    pages = [secrets.token_bytes(PAGE_BYTES) for _ in keys]
    with grpc.insecure_channel(h.address) as at_h:
        chunks = [data_pb2.PageChunk(key=k, namespace_id=ns, layout=LAYOUT, page_bytes=PAGE_BYTES, checksum=checksum(p), offset=0,
                                     data=p) for k, p in zip(keys, pages)]
        assert data_pb2_grpc.DataStub(at_h).WritePages(iter(chunks), metadata=_bearer(A), timeout=10).num_published == 4
    return ns, keys, pages


def _owned_by(node: str, n: int) -> list[bytes]:
    """``n`` page keys whose directory records only ``node`` owns among h and r (one owner a page)."""
    shards = ShardMap(["h", "r"], ShardConfig(segment_pages=1, replicas=1))
    keys: list[bytes] = []
    while len(keys) < n:
        key = secrets.token_bytes(16)
        if shards.owners(key) == (node,):
            keys.append(key)
    return keys


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


class CutHooks:
    """The receiver's first fetched batch's commit is held until the copy's task is being cancelled
    (the cut), then until the namespace's binding is settled or ``SETTLE_GRACE_S`` passed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.cut_seen = threading.Event()
        self.settled = threading.Event()
        self.committed = threading.Event()
        self.settled_before_commit = False
        hooks = self
        fetch_from, commit, settle = RemoteTier.fetch_from, QuotaLanding.commit, Tenancy.settle

        async def watched_fetch(tier: RemoteTier, *args: Any, **kw: Any) -> int:
            hooks.task = asyncio.current_task()
            return await fetch_from(tier, *args, **kw)

        def held_commit(landing: QuotaLanding, *args: Any) -> int:
            first = not hooks.cut_seen.is_set()
            if first:
                hooks.wait_for_cut()
                hooks.settled_before_commit = hooks.settled.wait(SETTLE_GRACE_S)
            try:
                return commit(landing, *args)
            finally:
                if first:
                    hooks.committed.set()

        def watched_settle(tenancy: Tenancy, *args: Any) -> None:
            settle(tenancy, *args)
            hooks.settled.set()

        monkeypatch.setattr(RemoteTier, "fetch_from", watched_fetch)
        monkeypatch.setattr(QuotaLanding, "commit", held_commit)
        monkeypatch.setattr(Tenancy, "settle", watched_settle)

    def wait_for_cut(self) -> None:
        for _ in range(int(WAIT_S / 0.005)):
            task = self.task
            if task is not None and (task.cancelling() or task.done()):
                self.cut_seen.set()
                return
            threading.Event().wait(0.005)
        raise AssertionError("the copy was never cut while its first batch committed")


def test_a_copy_cut_while_a_batch_commits_leaves_its_pages_readable_by_their_tenant(
        nodes: tuple[Server, Server], monkeypatch: pytest.MonkeyPatch) -> None:
    h, r = nodes
    monkeypatch.setattr(remote, "FETCH_PAGES", 2)  # two batches: the second lands while the first commits
    ns, keys, pages = _written_at(h)
    hooks = CutHooks(monkeypatch)
    with grpc.insecure_channel(r.address) as at_r:
        data = data_pb2_grpc.DataStub(at_r)
        request = data_pb2.ReplicateRequest(namespace_id=ns, keys=keys, replicas=1, holder="h", tenant="a", page_bytes=PAGE_BYTES)
        answer = data.Replicate.future(request, metadata=_bearer(NODE), timeout=DEADLINE_S)
        assert hooks.settled.wait(WAIT_S) and hooks.committed.wait(WAIT_S), "the copy never settled or committed"
        try:
            answered = answer.result().num_pages
        except grpc.RpcError as exc:  # it answered past its deadline: it waited on the held commit
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            answered = None
        held = [run for run in r.core.directory.lookup(ns, keys) if run.node == "r"]
        num_held = sum(run.num_pages for run in held)
        assert num_held == 2, held  # the first batch, committed after the cut; the second given back
        assert r.tenancy.owners.owner(ns) == "a", "pages stored at r in a namespace left unbound"
        assert answered in (None, num_held), "the answer is not what the copy stored"
        got = b"".join(c.data for c in data.ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys[:num_held]),
                                                     metadata=_bearer(A), timeout=10))
        assert got == b"".join(pages[:num_held]), "the tenant cannot read the pages stored for it"
        stats = directory_pb2_grpc.DirectoryStub(at_r).Stats(directory_pb2.StatsRequest(), metadata=_bearer(A), timeout=10)
    used = dict(next(t for t in stats.tenants if t.tenant == "a").used)
    assert used["host_bytes"] == num_held * PAGE_BYTES and used["allocations"] == 0, used
    counts = r.core.leases.counts()
    assert counts.num_allocations == 0 and not counts.pinned and not counts.moving, counts
    assert not hooks.settled_before_commit, "the call settled the namespace's binding while a batch's commit ran"
