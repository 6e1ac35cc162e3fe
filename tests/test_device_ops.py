"""The CPU implementation of the device seam (kvstore/device_ops.py), which the suite runs in
place of CUDA: it must fail where CUDA would silently go wrong (an engine waiting on a layer
whose copies were never issued, an unpin of what was never pinned), and its pools must give
their memory back whatever still holds a view. Also: an engine that cannot get or map its
pool reads through its arena (client/device_pool.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvstore.client import device_pool
from kvstore.client.device_pool import PoolSource
from kvstore.device_ops import CpuOps, PoolHandout, ops_for, ops_for_pool


def test_host_memory_has_no_device_ops_and_a_cpu_pool_the_cpu_implementation() -> None:
    assert ops_for(torch.device("cpu")) is None
    assert isinstance(ops_for_pool(torch.device("cpu")), CpuOps)


def test_pins_are_recorded_and_an_unpin_of_what_was_never_pinned_raises() -> None:
    ops = CpuOps()
    assert ops.pin_host(0x1000, 4096) and ops.pinned == {0x1000: 4096}
    ops.unpin_host(0x1000)
    assert ops.pinned == {}
    with pytest.raises(RuntimeError, match="not pinned"):
        ops.unpin_host(0x1000)


def test_waiting_on_an_event_never_recorded_raises() -> None:
    """CUDA would not wait at all, and the engine would read a layer still being copied."""
    ops = CpuOps()
    stream, event = ops.stream(), ops.event()
    with pytest.raises(RuntimeError, match="never recorded"):
        ops.wait(event)
    with ops.on(stream):
        ops.record(event, stream)
    ops.wait(event)
    ops.synchronize(stream)
    assert (ops.num_recorded, ops.num_waited) == (1, 1)


def test_a_pool_is_shared_memory_and_goes_back_even_with_a_view_left(caplog: pytest.LogCaptureFixture) -> None:
    ops = CpuOps()
    pool = ops.new_pool(1 << 20, b"t" * 16)
    assert pool.handout.fd >= 0 and pool.handout.size_bytes == 1 << 20 and pool.handout.token == b"t" * 16
    pool.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    opened = ops.open_pool(pool.handout, writable=False)
    assert opened.tensor[:4].tolist() == [1, 2, 3, 4], "another mapping of the same memory"
    kept = opened.tensor[:8]  # a view a load still holds
    with caplog.at_level(logging.DEBUG, logger="kvstore.device_ops"):
        opened.close()
    assert kept.tolist()[:4] == [1, 2, 3, 4], "the mapping stays while a view holds it"
    view = pool.tensor[:8]
    pool.tensor = torch.empty(0, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="kvstore.device_ops"):
        pool.release()
    assert "still has views" in caplog.text
    del view, kept


def test_a_pool_the_host_cannot_hold_closes_its_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    before = len(os.listdir("/proc/self/fd"))

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError):
        CpuOps().new_pool(1 << 20, b"t" * 16)
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_engine_without_its_pool_reads_through_its_arena(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket that refuses (or is gone): no mapping, asked once; a handout that cannot be
    mapped here: no mapping, and its descriptor closed."""
    source = PoolSource(str(tmp_path / "no.sock"), None)
    assert source.mapping() is None and source.mapping() is None
    fd = os.open("/dev/null", os.O_RDONLY)
    monkeypatch.setattr(device_pool, "receive_pool", lambda path, bearer: (PoolHandout("cpu", 1 << 20, b"t" * 16, fd=fd), "a"))
    assert PoolSource(str(tmp_path / "any.sock"), None).mapping() is None
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the source
