"""A page whose SSD index entry a restart finds damaged is quarantined, not kept unlisted: a
node that took it for stored would never fetch it from the nodes that hold it."""

from __future__ import annotations

from invalidation_cases import read_checked, tokens_owned_by
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from support.servers import ENTRY_HEADER_AT, flip_index_byte
from test_cluster_nodes import LAYOUT, NS

from kvstore.client import KVStoreClient
from kvstore.page import HEADER_CORE_BYTES


async def test_a_node_restarted_with_a_damaged_index_entry_fetches_that_page_from_its_holder(cluster_nodes) -> None:
    """Bug (the chaos model, seed 20006, check c: a lookup at n2 promised a page on n1, every get
    at n2 PageMissing, 15 s after the heal). b's restart left the first page of a namespace in
    its SSD tier, unlisted, because that page's index entry failed its check (an ssd_flip hit it);
    b then took the page for stored: a fetch of it from a, which holds it, allocated no slot for
    it and counted it as held, so b's reads of the prefix ended before it for good."""
    a, b = cluster_nodes(["a", "b"], "grpc")
    tokens = tokens_owned_by(["a", "b"], {"a"}, 2)  # a keeps the records: b asks a where its pages are
    kv = random_kv(LAYOUT, len(tokens), seed=20006)
    async with KVStoreClient(b.address, NS) as on_b:
        assert await on_b.put(tokens, kv, durable=True) == len(tokens)
        first = min((await on_b.lookup(tokens)).keys)  # recovery reads the namespace's layout from it (index order)
    b.stop()
    flip_index_byte(b.dir / "ssd", first, ENTRY_HEADER_AT + HEADER_CORE_BYTES - 1, 0x01)  # the header copy's own check
    b.start()  # on its data: ready once it serves
    async with KVStoreClient(a.address, NS) as on_a:
        assert await on_a.put(tokens, kv) == len(tokens)
    async with KVStoreClient(b.address, NS) as on_b:
        assert (await on_b.lookup(tokens)).num_tokens == len(tokens)  # a's copy of the page b lost, b's of the other
    assert await read_checked(b.address, tokens, kv, "b") == len(tokens), "b's get fell short of its lookup's promise"
