"""The cluster tests' etcd and ports: CI once lost a run to etcd failing to bind a port that free_port() had
seen free (bind(0) hands out ephemeral ports, which any outgoing connection can take in the meantime)."""

from __future__ import annotations

import socket
from pathlib import Path

from support.etcd_proc import EtcdProcess

from kvstore.bench.common.harness import _ephemeral_range, free_port


def test_free_ports_lie_outside_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert all(not low <= p <= high for p in ports)
    assert len(set(ports)) == len(ports)


def test_an_etcd_whose_port_was_taken_before_its_first_start_moves_to_free_ones(tmp_path: Path) -> None:
    etcd = EtcdProcess(tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", etcd.client_port))
        squatter.listen()
        taken = etcd.client_port
        etcd.start()
    try:
        assert etcd.client_port != taken
        with socket.create_connection(("127.0.0.1", etcd.client_port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            assert b'"health":"true"' in s.recv(4096)
    finally:
        etcd.stop()
