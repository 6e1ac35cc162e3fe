"""A client's mapping of the server's shared-memory arena.

Opened only when the file the server announced exists here and starts with the token the
server announced, i.e. client and server share a host. Otherwise pages go over gRPC.
"""

from __future__ import annotations

import logging
import mmap
import os

import numpy as np
import torch

from kvstore import cuda_host
from kvstore.page import ARENA_MAGIC as _MAGIC

logger = logging.getLogger(__name__)



class ArenaMap:
    def __init__(self, mm: mmap.mmap) -> None:
        self._mmap = mm
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self.array = np.frombuffer(mm, dtype=np.uint8)  # numpy slicing costs ~1 us, torch's ~10
        # With CUDA, page-locked: slot <-> GPU copies (layer-wise loads and saves) are then DMA.
        self._pinned_at = self._pin() if torch.cuda.is_available() else None

    def _pin(self) -> int | None:
        """CUDA ONLY. Pins this process's mapping; its address, or None when refused."""
        address = int(self.array.ctypes.data)
        return address if cuda_host.pin_host(address, len(self.array)) else None

    @classmethod
    def open(cls, path: str, size: int, token: bytes) -> ArenaMap | None:
        """The mapping, or None (with the reason logged) when this host cannot map it."""
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            logger.info("arena %s not reachable (%s); pages go over gRPC", path, exc.strerror)
            return None
        try:
            if os.fstat(fd).st_size != size:
                logger.info("arena %s has another size than announced; pages go over gRPC", path)
                return None
            # MAP_POPULATE maps the (already resident) arena up front: a first touch per 4 KiB
            # page would otherwise cost a fault on the hot path.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        if mm[: len(_MAGIC) + len(token)] != _MAGIC + token:
            logger.info("arena %s belongs to another server; pages go over gRPC", path)
            mm.close()
            return None
        return cls(mm)

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over one slot (no copy)."""
        return self.bytes[offset : offset + nbytes]

    def close(self) -> None:
        if self._pinned_at is not None:  # CUDA ONLY: before the mapping goes
            cuda_host.unpin_host(self._pinned_at)
            self._pinned_at = None
        del self.bytes
        del self.array
        try:
            self._mmap.close()
        except BufferError:
            logger.debug("arena mapping still referenced; left to the garbage collector")
