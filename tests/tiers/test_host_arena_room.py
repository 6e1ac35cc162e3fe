"""The host arena must fit in its shared-memory filesystem, or the server refuses to start."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from kvstore.config import HostTierConfig
from kvstore.errors import ConfigError
from kvstore.tiers.host import HostTier

SHM = Path("/dev/shm")


def test_an_arena_larger_than_its_shm_filesystem_is_refused_before_it_fills_it() -> None:
    """Bug: the arena was ftruncate'd (sparse) and mapped with MAP_POPULATE, which fails
    silently: --host-capacity 100GiB on a 24 GiB /dev/shm started, filled /dev/shm to 100%
    for every process of the host, and the first write past the room killed the server with
    SIGBUS (seen on a 64 MiB tmpfs: a 256 MiB arena 'created', then 'Bus error' writing at
    200 MiB). Now it is ConfigError naming --host-capacity, and nothing is left or filled."""
    fs = os.statvfs(SHM)
    node = f"room{uuid.uuid4().hex[:8]}"
    capacity = fs.f_blocks * fs.f_frsize + (64 << 20)  # more than the whole filesystem: refused at once
    with pytest.raises(ConfigError, match="--host-capacity"):
        HostTier(HostTierConfig(capacity_bytes=capacity, shm_dir=SHM), node=node)
    assert list(SHM.glob(f"kvstore-{node}-*")) == []


def test_a_directory_named_like_a_stale_arena_neither_stops_the_start_nor_is_removed(tmp_path: Path) -> None:
    """Bug: the sweep of stale arenas (``kvstore-<node>-*`` no process holds) took anything of that
    name: a directory there (etcd's data dir ``kvstore-etcd-<random>``, made by the tests and
    benches, beside a node named ``etcd``) made the server's start fail with IsADirectoryError.
    Only regular files are arenas; other things are not ours to judge."""
    node = f"dir{uuid.uuid4().hex[:8]}"
    other = tmp_path / f"kvstore-{node}-data"
    other.mkdir()
    (other / "member").write_bytes(b"x")
    tier = HostTier(HostTierConfig(capacity_bytes=4 << 20, shm_dir=tmp_path), node=node)
    try:
        assert other.is_dir() and (other / "member").exists()
    finally:
        tier.close()
