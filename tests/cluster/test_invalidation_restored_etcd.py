"""An etcd restored from a backup, as an invalidation at a node that never listed the nodes of the
history the backup lost sees it (DESIGN §12.4). The restore brings the incarnation id back, so no
node started afterwards tells it from the etcd it knew; its age must still bound what those nodes
may serve. Restarting etcd on the backup's data refreshes every lease in it, the young one's too."""

from __future__ import annotations

import shutil

from invalidation_cases import cut_off_later, invalidate, read_checked
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import EtcdProcess, etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS

from kvstore.bench.common.harness import stop_process
from kvstore.client import KVStoreClient
from kvstore.cluster.etcd import EtcdClient, parse_endpoints

ROOT = b"/kvstore/default/"
TOKENS = list(range(4 * LAYOUT.page_tokens))


def _restart_on(etcd: EtcdProcess, data: object | None, keep: object | None = None) -> None:
    """etcd stopped, its data copied to ``keep`` (a backup) or replaced by ``data`` (a restore), started again."""
    stop_process(etcd.proc, 10)
    if keep is not None:
        shutil.copytree(etcd.data_dir, keep)
    if data is not None:
        shutil.rmtree(etcd.data_dir)
        shutil.copytree(data, etcd.data_dir)
    etcd.start()


async def test_a_node_of_the_history_a_restored_backup_lost_is_waited_for(cluster_nodes, etcd, tmp_path) -> None:
    """The backup is of an etcd older than its young key's lease (no ``incarnation-young`` in it).
    x registers after the backup; cut off from etcd and its peers, it serves until its TTL is
    out. etcd is restored; c starts on it (same incarnation id, x never listed) and invalidates:
    confirmed only once x can no longer serve. Seen failing on c0df9e1 (the young key's absence
    counted as an hour's age: x served 64 tokens after c's OK); it passed on its parent, whose c
    waited a TTL from its own start."""
    client = EtcdClient(parse_endpoints(etcd.url))
    try:
        await client.put(ROOT + b"incarnation", b"0123456789abcdef0123456789abcdef 1000000000.000")
    finally:
        await client.close()
    backup = tmp_path / "etcd-backup"
    _restart_on(etcd, None, keep=backup)
    with cut_off_later(tmp_path, etcd.client_port, "x", "grpc", "--cluster-ttl", "10") as (x, cut):
        kv = random_kv(LAYOUT, len(TOKENS), seed=11)
        async with KVStoreClient(x.address, NS) as kvs:
            assert await kvs.put(TOKENS, kv) == len(TOKENS)
        assert await read_checked(x.address, TOKENS, kv, "before") == len(TOKENS)
        cut()
        _restart_on(etcd, backup)
        (c,) = cluster_nodes(["c"], "grpc", "--cluster-ttl", "10")
        await invalidate(c.address, NS.namespace_id, timeout_s=60)
        n = await read_checked(x.address, TOKENS, kv, "after c's OK")
        assert n == 0, f"x, of the history the restore lost, served {n} tokens of an invalidated generation " \
                       "after Invalidate returned OK at c"
