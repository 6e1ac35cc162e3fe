"""A promotion into hbm that finds a page damaged in the arena (DESIGN §4: every reader of the
arena checks it) drops it as any reader's find does (``Reader.quarantine_landing``): the arena
copy, and every lower copy it may have been read up from (read up unchecked, ``Mover.read_up``)
that fails its check too, so that damage on disk is dropped where it is instead of read up
again, and promised by every lookup, for the next reader. The real server, the hbm pool
emulated in host memory as tests/server/test_hbm_tier.py runs it."""

from __future__ import annotations

from support.kv import random_kv
from support.servers import flip_ssd_byte
from test_hbm_tier import _config, _remove_from

from kvstore.client import KVStoreClient


async def test_damage_on_disk_a_promotion_finds_is_dropped_on_disk_too(server_factory, tmp_path, layout, ns) -> None:
    server = server_factory(_config(tmp_path))
    tokens, kv = list(range(64)), random_kv(layout, 64, seed=13)
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv, durable=True)
        keys = (await client.lookup(tokens)).keys
    await _remove_from(server, ns, keys, "host")  # held on disk only
    assert all(set(server.core.where(k)) == {"ssd"} for k in keys)
    flip_ssd_byte(server, keys[2])
    lease, pages = server.core.acquire(ns.namespace_id, keys, 10_000, device=True)  # read up unchecked, then copied up
    server.core.release(lease)
    assert len(pages) == 4 and "hbm" not in server.core.where(keys[2])
    assert "ssd" not in server.core.where(keys[2]), "the damaged copy on disk stays, read up again by every reader"
