"""A restart with another --ssd-capacity keeps every stored page, or refuses to start."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.kv import random_kv
from support.servers import make_config

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError
from kvstore.server import Server

NUM_PAGES = 600  # more than one 16 MiB slab of 36 KiB slots (455)


async def _found(server: Server, ns, tokens: list[int], kv: torch.Tensor) -> int:
    async with KVStoreClient(server.address, ns) as client:
        hit = await client.lookup(tokens)
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out[:, :, : hit.num_tokens], kv[:, :, : hit.num_tokens])
        return hit.num_tokens


async def test_a_restart_with_another_ssd_capacity_keeps_every_durable_page(server_factory, tmp_path, layout, ns) -> None:
    """Bug: the SSD tier's slab size was derived from --ssd-capacity at each start, so a
    restart with another capacity laid a new slot grid over the data file and dropped from
    the index, for good, every page of a slab whose slots no longer lined up ('index entry
    overlaps another slot'): 7,280 durable pages written at 256MiB were 3,640 after one
    start at 2GiB, also when started at 256MiB again. A smaller capacity dropped the pages
    beyond it the same way. Now the slot grid of the pages on disk is kept (the slab size
    is kept in ssd/slabs.json), and a capacity too small for the stored pages is refused,
    naming --ssd-capacity, with nothing dropped."""
    config = make_config(tmp_path, host_bytes=64 << 20, ssd_bytes=64 << 20)
    tokens = list(range(NUM_PAGES * layout.page_tokens))
    kv = random_kv(layout, len(tokens))
    server = server_factory(config)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv, durable=True) == len(tokens)
    server.stop(grace_s=1)

    def ssd(capacity: int) -> object:
        assert config.ssd is not None
        return dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, capacity_bytes=capacity))

    server = server_factory(ssd(2 << 30))  # larger: a derived slab of 32 MiB
    assert await _found(server, ns, tokens, kv) == len(tokens)
    server.stop(grace_s=1)
    with pytest.raises(ConfigError, match="--ssd-capacity"):
        Server(ssd(16 << 20))  # one slab: less than the pages stored
    server = server_factory(config)
    assert await _found(server, ns, tokens, kv) == len(tokens)
