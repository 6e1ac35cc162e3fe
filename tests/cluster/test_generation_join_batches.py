"""A fresh node joins a cluster whose etcd holds a generation record of every namespace ever
invalidated (they stay for good), at ``--cluster-ttl 2`` within its default join timeout (3 TTLs,
at least 10 s), entering every one of them before it serves (DESIGN §12.5).

Before, it entered each generation in an LMDB transaction of its own, synced (about 0.9 ms each), and
the membership snapshot spawned a task per record: its loop was too busy to send keep-alives, it lost
its membership, and its start timed out having entered about 4,000 of 30,000."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Mapping

import lmdb
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture

from kvstore.cluster.etcd import EtcdClient, KeyValue, parse_endpoints
from kvstore.cluster.generation_records import EtcdGenerations
from kvstore.server.cluster.cluster_generations import ENTER_AT_ONCE, GenerationSync

ROOT = b"/kvstore/default/"  # the nodes' root (--cluster-name default)
NUM_GENERATIONS = 20_000  # before: its start timed out at 10 s, about 8,800 entered; now it joins in about 2 s
TXN_OPS = 48  # below etcd's default --max-txn-ops (128)


async def _fill_generations(url: str, n: int) -> None:
    client = EtcdClient(parse_endpoints(url), call_timeout_s=10.0)
    try:
        keys = [ROOT + b"generations/" + i.to_bytes(16, "big").hex().encode() for i in range(n)]
        for start in range(0, n, TXN_OPS):
            puts = [(k, json.dumps({"generation": 1 + i % 5, "issued_by": "filler"}).encode(), 0)
                    for i, k in enumerate(keys[start : start + TXN_OPS], start)]
            assert await client.put_if(puts, {})
    finally:
        await client.close()


def _entered(data_dir) -> dict[bytes, int]:
    env = lmdb.open(str(data_dir / "directory.lmdb"), readonly=True, max_dbs=6, lock=False)
    try:
        with env.begin() as txn:
            return {bytes(k): int(bytes(v)) for k, v in txn.cursor(db=env.open_db(b"generations", txn=txn))}
    finally:
        env.close()


async def test_a_node_joins_past_many_generation_records_within_its_default_timeout(cluster_nodes, etcd) -> None:
    await _fill_generations(etcd.url, NUM_GENERATIONS)
    started = time.monotonic()
    (a,) = cluster_nodes(["a"], "grpc")  # the default join timeout: RuntimeError "did not start" past it
    joined_s = time.monotonic() - started
    log = a.log.read_text(errors="replace")
    assert "stops acting as a member" not in log, f"the node lost its membership while catching up ({joined_s:.1f} s)"
    a.stop()
    entered = _entered(a.dir / "data")
    assert len(entered) == NUM_GENERATIONS
    assert all(entered[i.to_bytes(16, "big")] == 1 + i % 5 for i in range(NUM_GENERATIONS))


class _Core:
    """What ``GenerationSync`` enters generations into: each call recorded, none backwards."""

    def __init__(self) -> None:
        self.calls: list[dict[bytes, int]] = []
        self.held: dict[bytes, int] = {}
        self.threads: set[str] = set()

    def enter_generations(self, raised: Mapping[bytes, int]) -> dict[bytes, int]:
        self.threads.add(threading.current_thread().name)
        self.calls.append(dict(raised))
        time.sleep(0.01)  # a synced transaction
        above = {ns: g for ns, g in raised.items() if g > self.held.get(ns, 0)}
        self.held.update(above)
        return dict.fromkeys(above, 0)


def _record(records: EtcdGenerations, i: int, generation: int) -> KeyValue:
    key = records.prefix + i.to_bytes(16, "big").hex().encode()
    return KeyValue(key, json.dumps({"generation": generation}).encode(), 1, 1, 0)


async def test_a_snapshots_generations_are_entered_together_and_a_watch_event_at_once() -> None:
    """A snapshot delivers every record at once: one task enters them all, ``ENTER_AT_ONCE`` per worker-thread call
    (before: a task and a synced transaction each). A record delivered while they are entered is entered right after."""
    core, records = _Core(), EtcdGenerations(None, ROOT, "a")  # type: ignore[arg-type]  # parse needs no etcd
    sync = GenerationSync(core, records, None, None, "a", 2, 1.0)  # type: ignore[arg-type]  # heard needs neither
    n = 3 * ENTER_AT_ONCE + 5
    tasks = [sync.heard(_record(records, i, 2)) for i in range(n)]
    first, rest = tasks[0], tasks[1:]
    assert first is not None and rest == [None] * (n - 1)
    await asyncio.sleep(0)
    assert sync.heard(_record(records, 0, 1)) is None and sync.heard(_record(records, 1, 5)) is None  # meanwhile
    await asyncio.wait_for(first, 10)
    assert [len(c) for c in core.calls] == [ENTER_AT_ONCE] * 3 + [5, 2]
    assert core.held == {i.to_bytes(16, "big"): 5 if i == 1 else 2 for i in range(n)}  # never backwards
    assert threading.current_thread().name not in core.threads  # entered in worker threads
    alone = sync.heard(_record(records, n, 7))  # a watch event
    assert alone is not None
    await asyncio.wait_for(alone, 10)
    assert core.calls[-1] == {n.to_bytes(16, "big"): 7}
