"""Page-locking host memory for CUDA (``cudaHostRegister`` through torch), so that copies
between it and GPU memory are DMA at link speed instead of being staged through a driver
bounce buffer. Registration is per process: the server pins its mapping of the host arena
(tiers/pinned.py), a client its own (client/arena.py). Everything but ``host_address`` is
CUDA ONLY: CI (no GPU) never runs it; bench/gpu/run_device_checks.sh does.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly (CUDA 11.1): the device only reads it


def host_address(buffer: object) -> int:
    """The address of ``buffer``'s first byte (the numpy array that reads it is dropped at
    once, so the buffer keeps no export and its mmap can still be closed)."""
    return int(np.frombuffer(buffer, dtype=np.uint8, count=1).ctypes.data)  # type: ignore[call-overload]


def pin_host(address: int, num_bytes: int, read_only: bool = False) -> bool:
    """CUDA ONLY. Page-locks ``num_bytes`` of host memory at ``address``; False (logged)
    when the driver refuses (e.g. the locked-memory limit): copies still work, slower.
    ``read_only``: a PROT_READ mapping (a read-only token's arena), which the driver pins only so."""
    flags = CUDA_HOST_REGISTER_PORTABLE | (CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
    err = int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, flags))
    if err != 0:
        logger.warning("host memory not pinned (cudaHostRegister error %d); host<->GPU copies are staged", err)
        return False
    return True


def unpin_host(address: int) -> None:
    """CUDA ONLY. Undoes ``pin_host`` (before the memory is unmapped)."""
    err = int(torch.cuda.cudart().cudaHostUnregister(address))
    if err != 0:
        logger.warning("cudaHostUnregister error %d", err)
