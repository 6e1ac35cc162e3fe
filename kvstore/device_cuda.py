"""CUDA ONLY: ``CudaOps``, the CUDA implementation of ``device_ops.DeviceOps``.

These are the only lines of kvstore that CI (no GPU) never runs; everything around them
runs in the tests with ``device_ops.CpuOps``. tests_gpu/ (bench/gpu/run_device_checks.sh)
runs them on a GPU machine.

More: kvstore/README.md (### device_cuda.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

import torch

from kvstore.device_ops import DevicePool, OpenedPool, PoolHandout
from kvstore.errors import TierUnavailable

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly (CUDA 11.1): the device only reads it
SEGMENT_BYTES = 2 << 20  # the caching allocator's large-segment granularity


def _hex(value: bytes | None) -> str | None:
    return None if value is None else bytes(value).hex()


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else bytes.fromhex(value)


class CudaOps:
    """CUDA ONLY. See the module docstring."""

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.name = str(self.device)

    def pin_host(self, address: int, num_bytes: int, read_only: bool = False) -> bool:
        flags = CUDA_HOST_REGISTER_PORTABLE | (CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
        err = int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, flags))
        if err != 0:
            logger.warning("host memory not pinned (cudaHostRegister error %d); host<->GPU copies are staged", err)
            return False
        return True

    def unpin_host(self, address: int) -> None:
        err = int(torch.cuda.cudart().cudaHostUnregister(address))
        if err != 0:
            logger.warning("cudaHostUnregister error %d", err)

    def new_pool(self, num_bytes: int, token: bytes) -> DevicePool:
        size = -(-num_bytes // SEGMENT_BYTES) * SEGMENT_BYTES
        tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
        address = tensor.data_ptr()
        own = any(s["address"] == address and s["total_size"] == size for s in torch.cuda.memory_snapshot())
        if not own:
            del tensor
            raise TierUnavailable(f"the hbm pool on {self.name} shares a CUDA segment with other memory; its IPC "
                                  "handle would expose that memory too (start the server with no other CUDA work)")
        (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
         event_sync) = tensor.untyped_storage()._share_cuda_()
        exported = json.dumps({
            "device": int(device), "handle": _hex(handle), "storage_size_bytes": int(size_bytes),
            "storage_offset_bytes": int(offset_bytes), "ref_counter_handle": _hex(ref_handle),
            "ref_counter_offset": int(ref_offset), "event_handle": _hex(event_handle),
            "event_sync_required": bool(event_sync), "tensor_offset": int(tensor.storage_offset()),
            "num_bytes": num_bytes,
        })
        pool = tensor[:num_bytes]

        def release() -> None:
            nonlocal tensor, pool
            del tensor, pool
            torch.cuda.empty_cache()

        return DevicePool(pool, PoolHandout(self.name, num_bytes, token, handle=exported), release)

    def open_pool(self, handout: PoolHandout, writable: bool) -> OpenedPool:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        h = json.loads(handout.handle)
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([h["num_bytes"]]), (1,), h["tensor_offset"], torch.storage.TypedStorage,
            torch.uint8, h["device"], _bytes(h["handle"]), h["storage_size_bytes"], h["storage_offset_bytes"], False,
            _bytes(h["ref_counter_handle"]), h["ref_counter_offset"], _bytes(h["event_handle"]), h["event_sync_required"],
        )
        return OpenedPool(tensor, lambda: None)

    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()
