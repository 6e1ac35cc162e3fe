"""A copy from another node that raises after a batch of its pages was committed (DESIGN §11, §12.8):
the namespace's first binding is settled on what the copy stored, not undone.

Bug pinned here: ``Gate._copy_from`` (Replicate from a holder; a migration's Copy, ``_copy_pages``,
alike), ``HandoffGate.push`` (a handoff's Push) and ``ClusterReads.fill`` (a read of pages other
nodes hold) claim the namespace before the copy and settled it on the copy's answer; a copy that
raised (anything but the TimeoutError and KVStoreError ``ClusterRuntime.copy_from`` and ``fill``
turn into what is held) left that answer at 0, so the binding was undone while the batch committed
before the failure stayed stored: pages in an unbound namespace, unreadable by their tenant until
it wrote there again.

Two real in-process nodes on a real etcd, the TCP data plane, tenants with tokens (as
test_cut_copy_binding.py). The one stand-in: the copy's second batch fails unexpectedly as it lands."""

from __future__ import annotations

import secrets
from typing import Any

import grpc
import pytest
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.tenants import NODE, PAGE_BYTES, A
from test_cut_copy_binding import _bearer, _owned_by, _written_at, nodes  # noqa: F401  # nodes: the fixture

from kvstore._proto import data_pb2, data_pb2_grpc, handoff_pb2, handoff_pb2_grpc
from kvstore.server import Server
from kvstore.server.cluster import remote
from kvstore.server.cluster.remote import RemoteTier


@pytest.mark.parametrize("copy", ["replicate", "push", "read"])
def test_a_copy_that_raises_after_a_batch_committed_leaves_its_pages_their_tenants(
        nodes: tuple[Server, Server], monkeypatch: pytest.MonkeyPatch, copy: str) -> None:  # noqa: F811
    h, r = nodes
    monkeypatch.setattr(remote, "FETCH_PAGES", 2)  # two batches: the first committed as the second lands
    ns, keys, pages = _written_at(h)
    land_posted = RemoteTier._land_posted
    batches: list[int] = []

    async def second_fails(tier: RemoteTier, *args: Any, **kw: Any) -> Any:
        batches.append(len(batches))
        if len(batches) == 2:
            raise RuntimeError("an unexpected failure as the copy's second batch lands")
        return await land_posted(tier, *args, **kw)

    monkeypatch.setattr(RemoteTier, "_land_posted", second_fails)
    with grpc.insecure_channel(r.address) as at_r:
        data = data_pb2_grpc.DataStub(at_r)
        with pytest.raises(grpc.RpcError):  # the failure is the copy's answer
            if copy == "replicate":
                data.Replicate(data_pb2.ReplicateRequest(namespace_id=ns, keys=keys, replicas=1, holder="h", tenant="a",
                                                         page_bytes=PAGE_BYTES), metadata=_bearer(NODE), timeout=10)
            elif copy == "read":  # a read's fill of what other nodes hold
                list(data.ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys), metadata=_bearer(A), timeout=10))
            else:
                handoff_pb2_grpc.HandoffStub(at_r).Push(handoff_pb2.PushHandoffRequest(
                    namespace_id=ns, handoff_id=secrets.token_bytes(16), keys=keys, holder="h", tenant="a", page_bytes=PAGE_BYTES,
                    ttl_ms=30_000), metadata=_bearer(NODE), timeout=10)
        assert len(batches) == 2, "the copy did not reach its second batch"
        held = sum(run.num_pages for run in r.core.directory.lookup(ns, keys) if run.node == "r")
        assert held == 2, "the first batch was not committed before the failure"
        assert r.tenancy.owners.owner(ns) == "a", "pages stored at r in a namespace left unbound"
        got = b"".join(c.data for c in data.ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys[:held]),
                                                     metadata=_bearer(A), timeout=10))
        assert got == b"".join(pages[:held]), "the tenant cannot read the pages stored for it"
    counts = r.core.leases.counts()
    assert counts.num_allocations == 0 and not counts.pinned and not counts.moving, counts
