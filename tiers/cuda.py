"""The CUDA calls of the GPU tier, kept apart: the only lines CI (no GPU) never runs.

* ``export_pool`` / ``open_pool``: CUDA IPC of the hbm pool. The server exports the pool's
  allocation once; a same-host engine process opens it and reads pages in place (device to
  device, no host copy). The handle travels as plain JSON (bytes as hex), never pickled.

(Page-locking the host arena, ``cudaHostRegister``, is in kvstore/cuda_host.py: clients
use it too.)

Each is checked on a GPU machine by bench/gpu/run_device_checks.sh (tests_gpu/).
"""

from __future__ import annotations

import json
import logging

import torch

logger = logging.getLogger(__name__)

# -- CUDA ONLY below: not run in CI --------------------------------------------------------


def export_pool(pool: torch.Tensor) -> str:
    """CUDA ONLY. A JSON handle another process on this host opens with ``open_pool``. The
    exporting process must keep ``pool`` alive while any importer uses it."""
    if pool.device.type != "cuda":
        raise ValueError(f"only a CUDA pool can be exported, this one is on {pool.device}")
    (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = pool.untyped_storage()._share_cuda_()
    return json.dumps({
        "device": int(device), "handle": _hex(handle), "storage_size_bytes": int(size_bytes),
        "storage_offset_bytes": int(offset_bytes), "ref_counter_handle": _hex(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset), "event_handle": _hex(event_handle),
        "event_sync_required": bool(event_sync_required),
        "tensor_offset": int(pool.storage_offset()), "num_bytes": int(pool.numel()),
    })


def _hex(value: bytes | None) -> str | None:
    return None if value is None else bytes(value).hex()


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else bytes.fromhex(value)


def open_pool(exported: str) -> torch.Tensor:
    """CUDA ONLY. The pool a ``export_pool`` handle names, as a uint8 tensor on this
    process's view of the same device memory (no copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    h = json.loads(exported)
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([h["num_bytes"]]), (1,), h["tensor_offset"], torch.storage.TypedStorage, torch.uint8,
        h["device"], _bytes(h["handle"]), h["storage_size_bytes"], h["storage_offset_bytes"], False,
        _bytes(h["ref_counter_handle"]), h["ref_counter_offset"], _bytes(h["event_handle"]), h["event_sync_required"],
    )
