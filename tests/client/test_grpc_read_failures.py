"""A gRPC get that finds a page damaged (the pages come unchecked and the client checks each as it
lands, DESIGN §4) ends its stream at once: the server's lease, its pins and the stream's slot go
now, not when the server's idle watchdog (``--stream-idle-s``, 30 s) cancels the abandoned call.
Bug pinned (review of the change that made client reads unchecked): the client raised PageCorrupt
without cancelling the call, so each failed get left a stream open with every page of it pinned;
a few dozen such gets filled ``--max-streams`` and other tenants' reads and writes were refused."""

from __future__ import annotations

import torch
from support.cluster_nodes import eventually
from support.kv import random_kv
from support.servers import flip_arena_byte

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient
from kvstore.errors import PageCorrupt

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.float16, page_tokens=32)  # 1 MiB pages
PAGES = 48  # more than flow control lets the server send ahead: the stream is still open at the bad page


async def test_a_grpc_get_that_finds_a_page_damaged_leaves_nothing_held(server_factory) -> None:
    server = server_factory(host_bytes=256 << 20)
    ns = Namespace(model="demo", revision="r1", layout=LAYOUT)
    tokens = list(range(PAGES * LAYOUT.page_tokens))
    kv = random_kv(LAYOUT, len(tokens), seed=1)
    async with KVStoreClient(server.address, ns, use_shm=False) as client:
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.lookup(tokens)
        flip_arena_byte(server, server.core.where(hit.keys[1])["host"] + 100)  # a stray write into the arena
        out = torch.zeros_like(kv)
        try:
            await client.get(hit, into=out)
            raise AssertionError("the damaged page was not found")
        except PageCorrupt as exc:
            assert exc.num_tokens == LAYOUT.page_tokens
        assert hit.keys[1] in [q.key for q in server.core.quarantined()], "read again checked: quarantined"

        async def let_go() -> bool:
            counts = server.core.leases.counts()
            return counts.num_leases == 0 and not counts.pinned

        await eventually(let_go, 10.0, "the failed get's lease and pins released")
        assert (await client.lookup(tokens)).num_pages == 1
