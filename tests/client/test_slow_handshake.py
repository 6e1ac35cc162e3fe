"""A client reaches a server whose HTTP/2 handshake takes longer than 100 ms. gRPC reads
``grpc.min_reconnect_backoff_ms`` as the least time a connection attempt is given, and the
client's channels set it to 100 ms: a server whose SETTINGS frame came later (a long link, or
kvstore-bench crossover's link proxy behind a 160 ms GC pause) failed the first call UNAVAILABLE
'connection attempt timed out before receiving SETTINGS frame' (DESIGN §8)."""

from __future__ import annotations

from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.client import KVStoreClient


async def test_a_handshake_slower_than_100_ms_connects(server, ns) -> None:
    proxy = LinkProxy(server.address, 1e9, latency_s=0.3)  # the server's SETTINGS frame reaches the client after 0.3 s
    try:
        async with KVStoreClient(proxy.address, ns, use_shm=False, use_call_socket=False, timeout_s=10) as client:
            hit = await client.lookup(list(range(64)))
        assert hit.num_tokens == 0 and proxy.num_bytes > 0
    finally:
        proxy.close()
