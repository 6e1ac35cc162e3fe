"""etcd's incarnation age and the records of fenced nodes, by etcd's clock (DESIGN §12.4), on a
real etcd: what an issuer that never listed a node waits for."""

from __future__ import annotations

import asyncio
import time

from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture

from kvstore.bench.common.harness import stop_process
from kvstore.cluster.cluster_errors import CoordinatorUnavailable
from kvstore.cluster.etcd import EtcdClient, parse_endpoints
from kvstore.cluster.generation_records import YOUNG_S, EtcdGenerations
from kvstore.cluster.members import Member, MembershipConfig
from kvstore.cluster.membership import Membership
from kvstore.server.cluster.cluster_generations import GenerationSync

ROOT = b"/kvstore/t/"


async def test_a_new_incarnation_is_young_and_ages_by_etcds_clock(etcd) -> None:
    client = EtcdClient(parse_endpoints(etcd.url))
    try:
        records = EtcdGenerations(client, ROOT, "a")
        ident, age = await records.incarnation()
        assert age == 0.0
        again, age = await EtcdGenerations(client, ROOT, "b").incarnation()
        assert again == ident and 0.0 <= age < 1.0  # a lower bound: etcd rounds what is left down
        await asyncio.sleep(2.2)
        _, age = await records.incarnation()
        assert 1.0 <= age < 60  # at least the time slept, less a second of rounding; not YOUNG_S
    finally:
        await client.close()


async def test_an_incarnation_without_its_young_key_is_young_from_then(etcd) -> None:
    """An older kvstore made it: its age is unknown, so it is given a young key, counted from then
    (before, it counted as an hour old, and so did a backup restored without one)."""
    client = EtcdClient(parse_endpoints(etcd.url))
    try:
        await client.put(ROOT + b"incarnation", b"feed 1000.000")
        ident, age = await EtcdGenerations(client, ROOT, "a").incarnation()
        assert (ident, age) == (b"feed", 0.0)
        young = await client.get(ROOT + b"incarnation-young")
        assert young is not None and young.lease and (await client.lease_ttl(young.lease))[0] == YOUNG_S
    finally:
        await client.close()


async def test_an_etcd_restarted_on_its_data_is_young_again(etcd) -> None:
    """etcd renews every lease to its whole TTL when it starts: the age is the time since then, as
    for a backup restored (a node of the history it lost had its last keep-alive before)."""
    client = EtcdClient(parse_endpoints(etcd.url))
    try:
        records = EtcdGenerations(client, ROOT, "a")
        ident, _ = await records.incarnation()
        await asyncio.sleep(2.2)
        assert (await records.incarnation())[1] >= 1.0
        stop_process(etcd.proc, 10)
        restarting = time.monotonic()
        etcd.start()
        for _ in range(100):  # the channel finds the restarted etcd
            try:
                again, age = await records.incarnation()
                break
            except CoordinatorUnavailable:
                await asyncio.sleep(0.1)
        # counted from the restart (however long the channel took to find it on a slow host), not from before it
        assert again == ident and 0.0 <= age <= time.monotonic() - restarting + 0.1
    finally:
        await client.close()


async def test_a_fenced_record_outlives_the_fenced_nodes_serving(etcd) -> None:
    client = EtcdClient(parse_endpoints(etcd.url), call_timeout_s=1.0)
    try:
        records = EtcdGenerations(client, ROOT, "a")
        assert await records.fenced() == []
        await records.note_fenced("x", 0x51, 3.0)  # x may serve 3 s past its revoke
        await records.note_fenced("x", 0x52, 1.0)  # fenced again since, on a shorter TTL
        lefts = sorted(await records.fenced())
        assert len(lefts) == 2
        assert 4.0 <= lefts[1] <= 8.0  # 3 s + three calls of 1 s + 1 s, plus etcd's rounding, less the time since
        assert 2.0 <= lefts[0] <= 6.0 and lefts[0] < lefts[1]
    finally:
        await client.close()


async def test_a_node_fenced_outside_the_issuers_view_is_recorded_for_its_own_ttl(etcd) -> None:
    """The issuer's view may lack the node it fences (the view lags etcd): the record and the
    issuer's own wait go by the TTL etcd holds in the node's key (10 s), not the issuer's (2 s)."""
    client = EtcdClient(parse_endpoints(etcd.url), call_timeout_s=1.0)
    config = MembershipConfig("t", "a", ttl_s=2)
    try:
        lease, _ = await client.grant(10)
        x = Member("x", "127.0.0.1:1", "127.0.0.1:2", ttl_s=10)
        await client.put(ROOT + b"nodes/x", x.to_json(), lease)
        kv = await client.get(ROOT + b"nodes/x")
        membership = Membership(client, config, Member("a", "127.0.0.1:3", "127.0.0.1:4", ttl_s=2))  # its view: empty
        records = EtcdGenerations(client, ROOT, "a")
        sync = GenerationSync(None, records, membership, None, "a", 2, 1.0)  # type: ignore[arg-type]  # no placement needed
        started = time.monotonic()
        await sync._fence(b"\x01" * 16, 1, {"x": kv}, time.monotonic() + 10)
        (left,) = await records.fenced()
        # x may serve 11 s past the revoke (10 s x 1.05 + 0.5 s); the record's lease was granted after it, for 12 s
        assert 12 - (time.monotonic() - started) <= left <= 13  # not the noted margin of three calls (15 s) any more
        assert len((await client.get_prefix(ROOT + b"fenced/"))[1]) == 1
        assert await client.get(ROOT + b"nodes/x") is None  # revoked
    finally:
        await client.close()
