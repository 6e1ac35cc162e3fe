"""A direct handoff the decode node's tenant quota cuts short is answered at once (DESIGN §12.7).
The prefill node's Complete answers with what the decode node holds (4 of 8 pages); before, the
decode node completed its marker with every key the Push named (HandoffGate.push), so a decode's
wait for the whole prompt never saw it complete and slept out its whole deadline (the connector's
default: 10 s) before answering the same 4 pages. Found by an adversarial review (2026-12-08).
Two real nodes on a real etcd with tenants, as test_handoff_tenants.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_auth import A, secure_args
from test_cluster_nodes import LAYOUT, NS, tokens_of
from test_handoff_tenants import NODE_TOKEN, PAGE_BYTES

from kvstore.client import KVStoreClient, new_handoff_id

DEADLINE_S = 6.0


def _nodes(cluster_nodes, tmp_path: Path, monkeypatch) -> list:
    """Nodes a and c with tenants; tenant a's host quota at c is 4 pages."""
    from support.certs import CertAuthority

    monkeypatch.setenv("KVSTORE_CLUSTER_TOKEN", NODE_TOKEN)
    args = secure_args(tmp_path, CertAuthority(tmp_path / "ca"), ["a", "c"], NODE_TOKEN)
    auth = json.loads(Path(args["c"][1]).read_text())
    auth["quotas"] = {"a": {"host_bytes": 4 * PAGE_BYTES}}
    limited = tmp_path / "auth-c.json"
    limited.write_text(json.dumps(auth))
    limited.chmod(0o600)
    return cluster_nodes(["a", "c"], "tcp", each={"a": args["a"][:2], "c": ["--auth-file", str(limited)]})


async def test_a_handoff_cut_short_by_the_quota_is_answered_without_waiting_out_the_deadline(cluster_nodes, tmp_path,
                                                                                          monkeypatch) -> None:
    a, c = _nodes(cluster_nodes, tmp_path, monkeypatch)
    tokens = tokens_of(53, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=53)
    async with KVStoreClient(a.address, NS, token=A) as prefill, KVStoreClient(c.address, NS, token=A) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, "c", tokens=tokens)
        assert await prefill.put(tokens, kv) == len(tokens)
        handed = await prefill.handoff_complete(handoff, tokens)
        assert 0 < handed < len(tokens), handed  # the handoff is over: Complete answered what c holds
        started = time.monotonic()
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=DEADLINE_S)
        waited = time.monotonic() - started
        assert hit.num_tokens == handed
        assert waited < 2.0, (f"the decode's wait for a handoff that was complete ({handed} of {len(tokens)} tokens, "
                              f"the rest over the tenant's quota at c) took {waited:.1f} s: its whole deadline "
                              f"({DEADLINE_S:.0f} s)")


async def test_a_pool_handoff_cut_short_by_the_quota_is_answered_without_waiting_out_the_deadline(cluster_nodes, tmp_path,
                                                                                               monkeypatch) -> None:
    """The same through the pool (no decode node named): the decode node's pulls land what its
    tenant's quota holds, and the wait answers that once a pull could land nothing more."""
    a, c = _nodes(cluster_nodes, tmp_path, monkeypatch)
    tokens = tokens_of(54, 8)
    kv = random_kv(LAYOUT, len(tokens), seed=54)
    async with KVStoreClient(a.address, NS, token=A) as prefill, KVStoreClient(c.address, NS, token=A) as decode:
        handoff = new_handoff_id()
        await prefill.handoff_open(handoff, None, tokens=tokens)
        assert await prefill.put(tokens, kv) == len(tokens)
        assert await prefill.handoff_complete(handoff, tokens) == len(tokens)
        started = time.monotonic()
        hit = await decode.handoff_wait(handoff, tokens, deadline_s=DEADLINE_S)
        waited = time.monotonic() - started
        assert 0 < hit.num_tokens < len(tokens), hit.num_tokens
        assert waited < 2.0, f"the decode's wait for a pool handoff over the tenant's quota took {waited:.1f} s (deadline {DEADLINE_S:.0f} s)"
