"""The demoter is a reader too (DESIGN §4): a page that landed here unhashed from another node
and fails the demoter's check on its way to SSD is quarantined here, and the node it came from
is asked to check its own copy, as when an engine's copy finds it damaged. Real servers (the
receiver's background demoter, SSD below its arena), a real TCP or UCX page server on the
holder, over loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Any

import pytest
from support.servers import flip_arena_byte, make_config
from test_remote_landing import PAGE_BYTES, _found, _store
from test_remote_landing_unhashed import Peer, _quarantined, _serve

from kvstore.server.cluster.remote import RemoteTier


def _demoting_receiver(server_factory: Any, tmp_path: Any) -> Any:
    """A receiver whose demoter writes every landed page down at once (watermarks near 0)."""
    config = make_config(tmp_path / "receiver")
    return server_factory(dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.0001,
                                                                               demote_to=0.00005)))


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
async def test_a_landed_page_the_demoter_finds_damaged_is_quarantined_here_and_at_its_source(server_factory, tmp_path,
                                                                                             plane: str) -> None:
    holder, receiver = server_factory(), _demoting_receiver(server_factory, tmp_path)
    ns = secrets.token_bytes(16)
    keys = [secrets.token_bytes(16) for _ in range(4)]
    _store(holder.address, ns, keys, [secrets.token_bytes(PAGE_BYTES) for _ in keys])
    flip_arena_byte(holder, holder.core.where(keys[2])["host"] + 100)  # damaged at its source, sent as it is
    server, port = await _serve(plane, holder)
    try:
        peer = Peer(plane, port)
        tier = RemoteTier(receiver.core, {"holder": peer}, None, plane)  # type: ignore[arg-type]  # the holder alone
        assert await tier._fetch_posted(peer, ns, keys, PAGE_BYTES, 10.0) == 4  # type: ignore[arg-type]
        # no engine reads them: the demoter is the first reader, and it finds the damage
        assert await _quarantined(receiver, keys[2]), "the demoter wrote down or kept a damaged landed page"
        assert "ssd" not in receiver.core.where(keys[2])
        assert await _quarantined(holder, keys[2]), "the demoter's find did not reach the page's source"
        assert tier.source_checks.num_asked == 1
        assert _found(holder.address, ns, keys) == 2
        for _ in range(200):  # the rest go down whole
            if all("ssd" in receiver.core.where(k) for k in keys if k != keys[2]):
                break
            await asyncio.sleep(0.025)
        assert all("ssd" in receiver.core.where(k) for k in keys if k != keys[2])
        await peer.fetcher.close()
    finally:
        await server.close()
