"""A client made after its server restarted reaches it at once. gRPC shares subchannels
across the channels of a process: one that met the server down (connection refused) sits in
exponential back-off (1 s, 1.6 s, 2.6 s ...), and a new channel to the same address reused it,
failing with UNAVAILABLE 'connection refused' for seconds after the server was back (seen in
the chaos run of 2026-12-04: a client at a restarted node past 2 x TTL; and by the migration
tests, which retried)."""

from __future__ import annotations

import pytest
from support.servers import ServerProcess

from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError


async def test_a_client_made_after_a_restart_connects_at_once(store_process: ServerProcess, ns) -> None:
    async with KVStoreClient(store_process.address, ns):
        pass
    store_process.kill()
    for _ in range(4):  # clients that meet the server down: the shared subchannel backs off further each time
        with pytest.raises(KVStoreError):
            async with KVStoreClient(store_process.address, ns, timeout_s=0.5):
                pass
    store_process.start()
    # a fresh connection: before, the first call failed at once with UNAVAILABLE 'connection refused' (gRPC fails
    # a call fast while the shared connection backs off, whatever the call's deadline)
    async with KVStoreClient(store_process.address, ns, timeout_s=10) as client:
        assert client.node
