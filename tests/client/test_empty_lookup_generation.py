"""A lookup of no keys (a prompt shorter than a page) answers the namespace's generation the
server reads now, as any lookup does (DESIGN §3): a caller that names ``hit.generation`` in its
put is then refused only if an invalidation came in between. Before, the client answered 0
without asking: after any invalidation such a put was refused for a stale generation it never
saw. A real kvstore-server process."""

from __future__ import annotations

from support.kv import random_kv
from support.servers import ServerProcess

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient


async def test_a_lookup_of_no_keys_answers_the_current_generation(store_process: ServerProcess, ns: Namespace,
                                                                  layout: KVLayout) -> None:
    async with KVStoreClient(store_process.address, ns) as client:
        assert await client.invalidate() == 1
        empty = await client.lookup_keys([])
        assert empty.num_tokens == 0 and empty.generation == 1
        assert client.generation_seen == 1
        tokens = list(range(1, layout.page_tokens + 1))
        assert await client.put(tokens, random_kv(layout, len(tokens), 1), generation=empty.generation) == len(tokens)
