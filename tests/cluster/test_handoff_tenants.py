"""A handoff is bound to its tenant and namespace (DESIGN §12.7): another tenant waiting with the same
id, even naming the first tenant's namespace id and page keys outright, gets nothing at its
deadline, exactly as for an id nobody made, although the pages are held at the decode node."""

from __future__ import annotations

import time

import torch
from quota_nodes import quota_nodes
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_auth import A, B, secure_args
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import handoff_pb2
from kvstore.client import KVStoreClient, new_handoff_id

NODE_TOKEN = "cluster-node-token-0123456789ab"
PAGE_BYTES = LAYOUT.num_layers * 2 * LAYOUT.page_tokens * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2  # float16


async def test_another_tenant_or_a_forged_id_gets_nothing(cluster_nodes, tmp_path, monkeypatch) -> None:
    from support.certs import CertAuthority

    monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", NODE_TOKEN)
    args = secure_args(tmp_path, CertAuthority(tmp_path / "ca"), ["a", "c"], NODE_TOKEN)
    a, c = cluster_nodes(["a", "c"], "tcp", each={n: args[n][:2] for n in ("a", "c")})  # --auth-file only: loopback, tokens
    tokens = tokens_of(51, 4)
    kv = random_kv(LAYOUT, len(tokens), seed=51)
    async with KVStoreClient(a.address, NS, token=A) as prefill, KVStoreClient(c.address, NS, token=A) as decode, \
            KVStoreClient(c.address, NS, token=B) as other:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        assert await prefill.put(tokens, kv) == len(tokens)
        assert await prefill.handoff_complete(handoff, tokens) == len(tokens)

        async def waited(client: KVStoreClient, request: handoff_pb2.WaitHandoffRequest) -> tuple[int, float]:
            started = time.monotonic()
            answer = await client._call(client.runtime.handoff.Wait, request)
            return int(answer.num_pages), time.monotonic() - started

        ident = bytes.fromhex(handoff)
        own = handoff_pb2.WaitHandoffRequest(namespace_id=other.namespace.namespace_id, handoff_id=ident,
                                             keys=other.keys(tokens), deadline_ms=500)
        named = handoff_pb2.WaitHandoffRequest(namespace_id=decode.namespace.namespace_id, handoff_id=ident,
                                               keys=decode.keys(tokens), deadline_ms=500)
        forged = handoff_pb2.WaitHandoffRequest(namespace_id=decode.namespace.namespace_id,
                                                handoff_id=bytes.fromhex(new_handoff_id()), keys=decode.keys(tokens),
                                                deadline_ms=500)
        for request in (own, named, forged):  # b: its namespace, a's named outright, a forged id in a's
            pages, seconds = await waited(other, request)
            assert pages == 0 and seconds >= 0.5, (pages, seconds)
        # the handoff is intact for its tenant
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=2.0)
        assert hit.num_tokens == len(tokens)
        out = torch.zeros_like(kv)
        assert await decode.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)


async def test_handoff_pages_count_against_the_decode_nodes_quota_of_the_tenant(cluster_nodes, tmp_path, monkeypatch) -> None:
    """Tenant a may hold 4 pages in c's host tier: of an 8-page handoff, c takes what fits and
    the handoff says so (complete and wait answer the same shorter prefix); nothing is refused
    to the prefill node, which holds every page."""
    a, c = quota_nodes(cluster_nodes, tmp_path, monkeypatch, ["a", "c"], 4)
    tokens = tokens_of(52, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=52)
    async with KVStoreClient(a.address, NS, token=A) as prefill, KVStoreClient(c.address, NS, token=A) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        assert await prefill.put(tokens, kv) == len(tokens)
        handed = await prefill.handoff_complete(handoff, tokens)
        assert 0 < handed <= 4 * LAYOUT.page_tokens, handed
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=1.0)
        assert hit.num_tokens == handed
        out = torch.zeros_like(kv)
        assert await decode.get(hit, out) == handed
        assert torch.equal(out[:, :, :handed], kv[:, :, :handed])
