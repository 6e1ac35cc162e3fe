"""Cluster mode reaches an etcd whose HTTP/2 handshake takes longer than 100 ms (a TLS
handshake on a long link, an etcd under load). gRPC reads ``grpc.min_reconnect_backoff_ms``
as the least time one connection attempt is given: at 100 ms every attempt to such an etcd
timed out before its SETTINGS frame, and the node could never join (DESIGN §8, Connecting)."""

from __future__ import annotations

from support.etcd_proc import EtcdProcess, etcd_fixture  # noqa: F401  # the fixture

from kvstore.bench.common.linkproxy import LinkProxy
from kvstore.cluster.etcd import EtcdClient


async def test_an_etcd_whose_handshake_takes_longer_than_100_ms_is_reached(etcd: EtcdProcess) -> None:
    proxy = LinkProxy(etcd.endpoint, 1e9, latency_s=0.3)  # etcd's SETTINGS frame reaches the client after 0.3 s
    client = EtcdClient([proxy.address], call_timeout_s=5.0)
    try:
        await client.put(b"/slow-handshake", b"v")
        got = await client.get(b"/slow-handshake")
        assert got is not None and got.value == b"v" and proxy.num_bytes > 0
    finally:
        await client.close()
        proxy.close()
