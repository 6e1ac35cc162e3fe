"""What a cluster node prints on stdout: launchers read its first line as the ready signal."""

from __future__ import annotations

from support.cluster_nodes import Node
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture


def test_a_ucx_node_prints_ready_as_its_first_stdout_line(tmp_path, etcd) -> None:
    """Bug: UCX logs to stdout, and at start it warned there about UCX_MEMTYPE_CACHE (an
    environment variable ucxx sets that this UCX does not know), so a launcher that reads the
    server's first stdout line got a UCX warning instead of 'kvstore-server ready'."""
    node = Node(tmp_path, "a", etcd.url, "ucx")
    node.launch()
    try:
        assert node.proc is not None and node.proc.stdout is not None
        first = node.proc.stdout.readline()
        assert first.startswith("kvstore-server ready"), first
    finally:
        node.stop()
    assert node.proc.stdout.read() == ""  # UCX's messages, if any, went to stderr (the server's log)
