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
