"""Every call kvstore makes to an accelerator, behind one small seam, so that the code around
them is the same on a GPU and in the CPU tests.

More: kvstore/README.md (### device_ops.py).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolHandout:
    """What crosses the arena socket for a device pool: its device and size, and either a
    file descriptor (``fd``, the CPU implementation: shared memory) or a CUDA IPC handle
    (``handle``, JSON). ``token`` names the pool: an Acquire answer's device offsets are in the
    pool whose token it carries (a restarted server's pool is another)."""

    device: str
    size_bytes: int
    token: bytes
    fd: int = -1
    handle: str = ""


@dataclass
class DevicePool:
    """A pool made by ``DeviceOps.new_pool``: its memory as a uint8 tensor on the device,
    what hands it to another process, and how to free it (after every importer let go)."""

    tensor: torch.Tensor
    handout: PoolHandout
    release: Callable[[], None]


@dataclass
class OpenedPool:
    """This process's mapping of another process's pool (``DeviceOps.open_pool``)."""

    tensor: torch.Tensor
    close: Callable[[], None]


class DeviceOps(Protocol):
    """The seam. Thread-safety: every method may be called from any thread. A failure of
    the device raises (RuntimeError from torch); ``pin_host`` alone answers False instead
    (unpinned memory still copies, slower)."""

    name: str  # the device pools and streams are on: "cuda:0", "cpu"

    def pin_host(self, address: int, num_bytes: int, read_only: bool = False) -> bool:
        """Page-locks host memory the device copies from or into (DMA at link speed)."""
        ...

    def unpin_host(self, address: int) -> None:
        """Undoes ``pin_host``, before the memory is unmapped."""
        ...

    def new_pool(self, num_bytes: int, token: bytes) -> DevicePool:
        """``num_bytes`` of device memory in an allocation of its own (another process that
        maps it sees this pool and nothing else of this process)."""
        ...

    def open_pool(self, handout: PoolHandout, writable: bool) -> OpenedPool:
        """Maps a pool another process of this host handed out (the caller owns ``handout.fd``
        and closes it)."""
        ...

    def stream(self) -> Any:
        """A side stream: copies issued on it overlap the engine's own work."""
        ...

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Copies issued inside go on ``stream``."""
        ...

    def event(self) -> Any:
        """An event to record on a stream and wait on from another."""
        ...

    def record(self, event: Any, stream: Any) -> None:
        """``event`` completes once the copies issued on ``stream`` so far are done."""
        ...

    def wait(self, event: Any) -> None:
        """The calling thread's current stream (the engine's) waits for ``event``; the host does not."""
        ...

    def synchronize(self, stream: Any) -> None:
        """Blocks the host until every copy issued on ``stream`` is done."""
        ...


def host_address(buffer: object) -> int:
    """The address of ``buffer``'s first byte (the numpy array that reads it is dropped at
    once, so the buffer keeps no export and its mmap can still be closed)."""
    return int(np.frombuffer(buffer, dtype=np.uint8, count=1).ctypes.data)  # type: ignore[call-overload]


def ops_for(device: torch.device) -> DeviceOps | None:
    """The ops of a tensor's device; None for host memory (the host copy path, no streams)."""
    if device.type != "cuda":
        return None
    from kvstore.device_cuda import CudaOps

    return CudaOps(device)


def ops_for_pool(device: torch.device) -> DeviceOps:
    """The ops of an hbm pool's device (``--hbm-device``, checked by tiers.hbm.check_device):
    CUDA, or cpu, the CPU implementation (the test emulation of the pool)."""
    if device.type == "cpu":
        return CpuOps()
    from kvstore.device_cuda import CudaOps

    return CudaOps(device)


def _shared(mm: mmap.mmap) -> torch.Tensor:
    """``mm`` as a uint8 tensor through a numpy array that holds an export of it: while any
    view lives, ``mm.close()`` raises BufferError instead of unmapping memory a view still
    reads (torch.frombuffer keeps no export: a view would then read unmapped memory)."""
    import torch

    with warnings.catch_warnings():  # torch warns that it cannot mark a tensor read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


class CpuEvent:
    """An event of the CPU implementation: it knows whether it was recorded."""

    def __init__(self) -> None:
        self.recorded = False


class CpuOps:
    """The CPU implementation of ``DeviceOps`` (see the module docstring). ``pinned``: the
    ranges page-locked now, address -> bytes; ``num_recorded``/``num_waited``: events recorded
    and waited on, for tests that check the ordering a GPU would need."""

    name = "cpu"

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.num_recorded = 0
        self.num_waited = 0
        self._lock = threading.Lock()

    def pin_host(self, address: int, num_bytes: int, read_only: bool = False) -> bool:
        with self._lock:
            self.pinned[address] = num_bytes
        return True

    def unpin_host(self, address: int) -> None:
        with self._lock:
            if self.pinned.pop(address, None) is None:
                raise RuntimeError(f"unpin of {address:#x}, which is not pinned")

    def new_pool(self, num_bytes: int, token: bytes) -> DevicePool:
        fd = os.memfd_create("kvstore-hbm-pool", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, num_bytes)
            os.posix_fallocate(fd, 0, num_bytes)  # reserved now: a sparse pool would SIGBUS when memory runs out
            mm = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        tensor = _shared(mm)

        def release() -> None:
            nonlocal tensor
            del tensor
            try:
                mm.close()
            except BufferError:
                logger.warning("hbm pool (emulated) still has views at close; leaving the mapping")
            os.close(fd)

        return DevicePool(tensor, PoolHandout(self.name, num_bytes, token, fd=fd), release)

    def open_pool(self, handout: PoolHandout, writable: bool) -> OpenedPool:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(handout.fd, handout.size_bytes, flags=mmap.MAP_SHARED, prot=prot)
        tensor = _shared(mm)

        def close() -> None:
            nonlocal tensor
            del tensor
            try:
                mm.close()
            except BufferError:
                logger.debug("pool mapping still referenced; left to the garbage collector")

        return OpenedPool(tensor, close)

    def stream(self) -> object:
        return object()

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def event(self) -> CpuEvent:
        return CpuEvent()

    def record(self, event: Any, stream: Any) -> None:
        event.recorded = True
        with self._lock:
            self.num_recorded += 1

    def wait(self, event: Any) -> None:
        if not event.recorded:  # CUDA would not wait at all: the engine would read a layer still being copied
            raise RuntimeError("waited on an event that was never recorded")
        with self._lock:
            self.num_waited += 1

    def synchronize(self, stream: Any) -> None:
        pass
