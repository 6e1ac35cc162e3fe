"""A hint's prefetch slot is given back however the prefetch fails to start (DESIGN §12.4,
defect 10): the runtime counted a prefetch before handing it to its loop, and when the hand-
over raised (the loop closed: the node stopping) the slot was never given back; after four,
hints never prefetched again."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from support.etcd_proc import etcd_fixture, free_port  # noqa: F401  # the fixture
from support.servers import make_config

from kvstore.config import ClusterConfig
from kvstore.server import Server
from kvstore.server.cluster.cluster_runtime import MAX_PREFETCHES


def test_a_prefetch_that_cannot_start_gives_its_slot_back(etcd, tmp_path: Path) -> None:
    port = free_port()
    cluster = ClusterConfig(etcd=etcd.url, node_id="n", advertise=f"127.0.0.1:{port}", data_plane="grpc", ttl_s=5)
    server = Server(replace(make_config(tmp_path, cluster=cluster, node="n"), listen=f"127.0.0.1:{port}"))
    server.start()
    try:
        runtime = server.cluster
        assert runtime is not None and runtime.serving
        loop = runtime._loop
        loop.call_soon_threadsafe(loop.stop)
        runtime._thread.join(5)
        loop.close()  # what a stopping node's loop is: handing it work raises RuntimeError
        keys = [bytes([i]) * 16 for i in range(2)]
        for _ in range(MAX_PREFETCHES + 2):
            assert runtime.prefetch(b"n" * 16, keys) is False
        assert runtime._prefetching == 0, "a prefetch that never started kept its slot"
    finally:
        server.stop()
