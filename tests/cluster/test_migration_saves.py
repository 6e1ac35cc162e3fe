"""A migrated session's page saves at the source, on real nodes over a real etcd (DESIGN §12.8):
after the fence every save naming the session is refused with SessionFenced and counted
(put / put_keys over the arena and over streams, layer-wise saves on both paths), and so is the
commit of an allocation taken before the fence, which leaves nothing behind; a commit that lands
before the fence is in the target's copy (the last delta). The interleavings are driven by
explicit steps (the migration's round callback), never by timing."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture, free_port  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS, tokens_of

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient
from kvstore.client.pages import slot_as_page
from kvstore.client.transport import ShmTransport
from kvstore.client.transport.contract import Outgoing, page_in
from kvstore.errors import SessionFenced
from kvstore.page import LayoutDesc, checksum

PAGE = LAYOUT.page_tokens
PAGE_BYTES = LayoutDesc.of(LAYOUT).page_bytes


async def _held(client: KVStoreClient) -> tuple[int, int]:
    """(host tier used bytes, leases) of the client's node."""
    stats = await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())
    return next(t.used_bytes for t in stats.tiers if t.tier == "host"), int(stats.num_leases)


def _refusals(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {call: float(n) for call, n in re.findall(r'kvstore_session_fenced_refusals_total\{call="(\w+)"\} (\S+)', text)}


async def _reserved(client: KVStoreClient, session_id: str, keys: list[bytes], first: int, kv: torch.Tensor) -> tuple[Outgoing, list[int]]:
    """Slots of the arena allocated for pages ``first..`` of ``keys`` (naming the session) and filled
    from ``kv``, not committed yet; with their checksums."""
    assert isinstance(client.transport, ShmTransport)  # nodes on this host: the arena path (Allocate, then Commit)
    out = client.transport.outgoing(session_id)
    await client._io(out.reserve(keys[first:], keys[first - 1]))
    for i, buffer in zip(out.indices, out.buffers):
        page_in(slot_as_page(buffer, LAYOUT), kv, first + i, LAYOUT)
    return out, [checksum(buffer.numpy()) for buffer in out.buffers]


async def test_after_the_fence_the_sources_saves_of_the_session_are_refused_counted_and_leave_nothing(cluster_nodes) -> None:
    port = free_port()
    a, b = cluster_nodes(["a", "b"], "tcp", each={"a": ["--metrics-listen", f"127.0.0.1:{port}"]})
    tokens = tokens_of(380, 6)
    kv = random_kv(LAYOUT, len(tokens), seed=380)
    four = 4 * PAGE
    async with KVStoreClient(a.address, NS) as src, KVStoreClient(a.address, NS, use_shm=False) as streamed, \
            KVStoreClient(b.address, NS) as dst:
        log = src.session("f1")
        await log.start(tokens[:four])
        assert await src.put(tokens[:four], kv[:, :, :four], session_id="f1") == four
        keys = src.keys(tokens)
        before = await _held(src)
        late, sums = await _reserved(src, "f1", keys, 4, kv)  # allocated before the fence ...
        summary = await src.migrate("f1", "b", max_pause_bytes=0)
        assert summary.version == 1
        with pytest.raises(SessionFenced, match="fenced: version 1 .* node b"):  # ... committed after it: refused
            await src._io(late.publish(sums, False))
        assert await _held(src) == before  # its slots freed, its pins dropped, nothing published
        await src._io(late.discard())  # the client's own give-back finds nothing left
        for save in (src.put(tokens, kv, session_id="f1"), src.put_keys(keys, kv, session_id="f1"),
                     streamed.put(tokens, kv, session_id="f1"), streamed.put_keys(keys, kv, session_id="f1")):
            with pytest.raises(SessionFenced):
                await save
        for saver in (src, streamed):  # layer-wise: refused at Allocate (arena), at the stream's first page
            with pytest.raises(SessionFenced):
                await saver.save(tokens, kv, start=four, session_id="f1").finished()
        assert _refusals(port) == {"Allocate": 3, "WritePages": 3, "Commit": 1}
        assert await _held(src) == before
        for client in (src, dst):  # nothing of the session was published after the fence, at either node
            assert (await client.lookup(tokens)).num_tokens == four
        assert await src.put(tokens, kv, session_id="other") == len(tokens)  # a's other sessions save on


async def test_a_save_committed_before_the_fence_is_in_the_targets_copy(cluster_nodes) -> None:
    a, b = cluster_nodes(["a", "b"], "tcp")
    tokens = tokens_of(381, 6)
    kv = random_kv(LAYOUT, len(tokens), seed=381)
    four = 4 * PAGE
    async with KVStoreClient(a.address, NS) as src, KVStoreClient(b.address, NS) as dst:
        log = src.session("f2")
        await log.start(tokens[:four])
        assert await src.put(tokens[:four], kv[:, :, :four], session_id="f2") == four
        await log.returned(tokens[four:])
        await log.flush()
        late, sums = await _reserved(src, "f2", src.keys(tokens), 4, kv)

        async def commit_late(round_: int, *_: int) -> None:
            if round_ == 1:  # after the last pre-copy round, before the fence: it lands
                assert await src._io(late.publish(sums, False)) == 2

        # the rest (2 pages) is under the pause threshold after round 1: the fence follows at once
        summary = await src.migrate("f2", "b", max_pause_bytes=1 << 40, on_round=commit_late)
        assert summary.version == 1 and summary.rounds == 1
        assert summary.round_bytes == [4 * PAGE_BYTES, 2 * PAGE_BYTES]  # the late pages were the last delta
        await src._io(late.discard())
        hit = await dst.lookup(tokens)
        assert hit.num_tokens == len(tokens) and {r.node for r in hit.runs} == {"b"}
        out = torch.zeros_like(kv)
        assert await dst.get(hit, out) == len(tokens)
        assert torch.equal(out, kv)
