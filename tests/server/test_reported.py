"""A reader's report of a corrupt page costs the server a hash of that page: bounded per
tenant, so that Acquire + Release naming pages in a loop cannot make the server hash without
end (found by a review of 36c0631: 128 MiB hashed per 1 KiB request)."""

from __future__ import annotations

import grpc
import torch
from support.kv import random_kv
from test_durability import _flip_payload_byte

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.server.placement.reported import CHECKS_PER_S, ReportBudget


def test_each_tenant_has_a_few_checks_a_second() -> None:
    now = [100.0]
    budget = ReportBudget(clock=lambda: now[0])
    granted = sum(budget.take("a") for _ in range(100))
    assert granted == int(CHECKS_PER_S)
    assert budget.take("b"), "another tenant's budget is its own"
    now[0] += 0.5
    assert sum(budget.take("a") for _ in range(100)) == int(CHECKS_PER_S / 2)
    now[0] += 60
    assert sum(budget.take("a") for _ in range(100)) == int(CHECKS_PER_S), "the bucket holds no more than a second's"


async def test_a_release_of_a_lease_without_the_named_page_spends_none_of_the_budget(server_factory, tmp_path, layout,
                                                                                      ns) -> None:
    """A layer-wise load of more pages than one Acquire may lease holds several leases and names
    the page that failed its copy at each release (only the lease holding it has it checked).
    Each such Release took a check from the tenant's budget before its keys were looked at, so
    the releases of the first leases spent it all and the lease that held the page, released
    after them, had it left unchecked: a page damaged on disk, read up unchecked (DESIGN §4),
    stayed listed, and every later load of it found it and reported it again in vain. Only a
    page the lease holds, which is then hashed, takes from the budget."""
    server = server_factory(max_pages_per_request=2)
    tokens, kv = list(range(12 * layout.page_tokens)), random_kv(layout, 12 * layout.page_tokens, seed=8)
    async with KVStoreClient(server.address, ns) as client:
        keys, p = client.keys(tokens), layout.page_tokens
        for i in range(0, 12, 2):  # two pages a request
            assert await client.put_keys(keys[i : i + 2], kv[:, :, i * p : (i + 2) * p].contiguous(), durable=True) == 2 * p
        hit = await client.lookup(tokens)
        bad = hit.keys[10]  # in the sixth lease
        async with grpc.aio.insecure_channel(server.address) as ch:
            for i in range(0, 12, 2):
                await directory_pb2_grpc.DirectoryStub(ch).Remove(directory_pb2.RemoveRequest(
                    namespace_id=ns.namespace_id, keys=hit.keys[i : i + 2], tier="host"))
        _flip_payload_byte(tmp_path / "ssd", server.core.where(bad)["ssd"], where=100)
        load = client.load(hit, into=torch.zeros_like(kv), deadline_s=30)
        assert await load.finished() == 10 * layout.page_tokens
        assert server.core.where(bad) == {}, "the page the load found damaged is promised by every lookup"
        assert (await client.lookup(tokens)).num_pages == 10
    assert not server.core.view().pinned
