"""With hbm every host arena is page-locked for the pools' copies and unpinned before it is
unmapped (DESIGN §6; tenant arenas, pinned as they are made: tests/security/
test_tenant_pools.py). Page-locking is CUDA-only (cudaHostRegister), so the decision and the
registration are checked through the device seam's CPU implementation (``CpuOps.pinned``),
on a real server with a real arena."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from support.servers import make_config

from kvstore.config import HbmTierConfig
from kvstore.device_ops import CpuOps, host_address
from kvstore.server import Server

HBM = HbmTierConfig(capacity_bytes=2 << 20, slab_bytes=1 << 20, device="cpu")


def pinned_arenas(server: Server) -> tuple[CpuOps, dict[int, int]]:
    """The seam's record of what is pinned, and what should be: every arena, whole."""
    ops = server.core.landing.pins.ops
    assert isinstance(ops, CpuOps)
    return ops, {host_address(part.memory()): len(part.memory()) for part in server.core.landing.parts()}


def test_the_one_arena_is_pinned_while_the_server_runs(tmp_path: Path) -> None:
    server = Server(dataclasses.replace(make_config(tmp_path), tiers=("hbm", "host", "ssd"), hbm=HBM))
    server.start()
    ops, arenas = pinned_arenas(server)
    try:
        assert len(arenas) == 1 and ops.pinned == arenas
    finally:
        server.stop(grace_s=1)
    assert ops.pinned == {}, "unpinned before it was unmapped"


def test_without_hbm_nothing_is_pinned(server) -> None:
    assert getattr(server.core.landing, "pins", None) is None
