"""kvstore-server's cluster flags: parsed into a ClusterConfig only with --cluster; a bad
combination is refused naming the flag that fixes it."""

from __future__ import annotations

import pytest

from kvstore.cli.server import build_parser, config_from_args
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError


def parse(*argv: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(["--listen", "127.0.0.1:7070", *argv]))


def test_without_cluster_nothing_changes() -> None:
    config = parse("--node", "solo")
    assert config.cluster is None and config.node == "solo"


def test_cluster_flags_make_the_node_id_the_node_name() -> None:
    config = parse("--cluster", "etcd://127.0.0.1:2379", "--node-id", "n1", "--data-plane", "grpc")
    assert config.node == "n1"
    assert config.cluster is not None
    assert (config.cluster.advertise, config.cluster.data_plane, config.cluster.ttl_s) == ("127.0.0.1:7070", "grpc", 10)


@pytest.mark.parametrize(("argv", "flag"), [
    (["--cluster", "etcd://127.0.0.1:2379"], "--node-id"),
    (["--node-id", "n1"], "--cluster"),
    (["--cluster", "etcd://127.0.0.1:2379", "--node-id", "n1", "--advertise", "127.0.0.1:0"], "--advertise"),
    (["--cluster", "etcd://127.0.0.1:2379", "--node-id", "n1", "--cluster-ttl", "1"], "--cluster-ttl"),
    (["--cluster", "etcd://127.0.0.1:2379", "--node-id", "n1", "--advertise-data-port", "70000"], "--advertise-data-port"),
    (["--cluster", "etcd://127.0.0.1:2379", "--node-id", "n1", "--cluster-replicas", "0"], "--cluster-replicas"),
])
def test_bad_cluster_flags_are_refused(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        parse(*argv)


def test_help_shows_the_defaults() -> None:
    text = build_parser().format_help()
    assert "--data-plane {ucx,tcp,grpc}" in text and "plain TCP sockets" in " ".join(text.split()) and "(default: ucx)" in text and "--cluster-ttl" in text
