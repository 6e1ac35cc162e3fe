"""Every tenant's salt read back from etcd past the channel's receive limit (gRPC's 4 MiB by
default; DESIGN §11-12): ``EtcdSalts.reseed`` read the whole prefix in one Range on its own
channel, so with some 40,000 tenants (or fewer, larger keys) every reseed after etcd was
replaced failed RESOURCE_EXHAUSTED and the salts were never put back. Filler keys with padded
values pass the limit here with few keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture

from kvstore.cluster.etcd import MAX_RECEIVE_BYTES, EtcdClient, parse_endpoints
from kvstore.cluster.salt_records import EtcdSalts

PAD_BYTES = 16 * 1024
TXN_OPS = 48  # under etcd's --max-txn-ops and, with these values, its --max-request-bytes
NUM_BIG = (MAX_RECEIVE_BYTES + (1 << 20)) // PAD_BYTES  # past the limit the channel was raised to: paged, not raised


async def _fill(url: str, prefix: bytes) -> None:
    client = EtcdClient(parse_endpoints(url), call_timeout_s=10.0)
    try:
        items = [(prefix + b"filler-%05d" % i, b"v" * PAD_BYTES) for i in range(NUM_BIG)]
        for start in range(0, len(items), TXN_OPS):
            assert await client.put_if([(k, v, 0) for k, v in items[start : start + TXN_OPS]], {})
        await client.delete(prefix + b"tenant-a")  # etcd replaced: it lost a's salt
    finally:
        await client.close()


def test_a_reseed_reads_every_salt_past_the_receive_limit(etcd, tmp_path: Path) -> None:
    salts = EtcdSalts(tmp_path / "n1", [etcd.endpoint], "big")
    try:
        a = salts.salt("tenant-a")
        asyncio.run(_fill(etcd.url, b"/kvstore/big/tenant-salts/"))
        assert salts.reseed() == ["tenant-a"]  # put back from this node's copy
        assert salts.reseed() == []
        late = EtcdSalts(tmp_path / "late", [etcd.endpoint], "big")  # a node joining later reads the same
        try:
            assert late.salt("tenant-a") == a
        finally:
            late.close()
    finally:
        salts.close()
