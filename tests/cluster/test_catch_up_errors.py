"""A catch-up that fails in an unforeseen way is retried, not given up: the catch-up task let any exception but
etcd's unavailability end it, and the node, registered but never caught up, answered every read as empty until it
registered again (a salts file it could not write, a bug in a reseed hook)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from support.etcd_proc import etcd_fixture, free_port  # noqa: F401  # the fixture
from support.servers import make_config

from kvstore.config import ClusterConfig
from kvstore.server import Server


def test_a_catch_up_hook_that_raises_is_retried_until_the_node_serves(etcd, tmp_path: Path) -> None:
    port = free_port()
    cluster = ClusterConfig(etcd=etcd.url, node_id="n", advertise=f"127.0.0.1:{port}", data_plane="grpc", ttl_s=2)
    server = Server(replace(make_config(tmp_path, cluster=cluster, node="n"), listen=f"127.0.0.1:{port}"))
    server.start()
    try:
        runtime = server.cluster
        assert runtime is not None and runtime.serving and runtime.generations is not None
        hook = runtime.generations._before_serving
        failures = []

        def failing_thrice() -> object:  # etcd's replacement starts two catch-ups (the new registration's, the wipe's)
            if len(failures) < 3:
                failures.append(time.monotonic())
                raise OSError(28, "No space left on device")  # e.g. the salts file could not be written
            return hook() if hook is not None else None

        runtime.generations._before_serving = failing_thrice
        etcd.wipe()  # the node finds its lease gone, registers in the new etcd and catches up again
        deadline = time.monotonic() + 30
        while not (len(failures) == 3 and runtime.serving) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures, "the node never caught up again after etcd was replaced"
        assert runtime.serving, "a catch-up that raised was never retried: the node serves nothing"
    finally:
        server.stop()
