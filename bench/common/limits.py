"""The limits the throughput paths chase: memcpy (ordinary and non-temporal stores) for the
shared-memory paths; raw disk (O_DIRECT page writes + fdatasync and O_DIRECT reads of the
same bytes on the same filesystem) for the SSD paths. (The raw gRPC pump is rawgrpc.py.)"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvstore import pagecopy


class Memcpy:
    """Copies of the path's bytes into a buffer of their size, two ways: ordinary stores
    (torch ``copy_``, on its own threads) and the non-temporal stores the shared-memory path
    writes slots with (``pagecopy.copy_streamed``, one slice per thread of the client's copy
    pool). Which is faster depends on the machine; the limit is the better of the two, so
    that a streamed path is not measured against a slower copy than it could be."""

    def __init__(self, src: torch.Tensor, threads: int = 2) -> None:
        self.src = src
        self.dst = torch.empty_like(src)
        self.dst.view(torch.uint8).fill_(0)  # touched once: first-touch faults are not a copy
        src_bytes, dst_bytes = src.view(torch.uint8).reshape(-1).numpy(), self.dst.view(torch.uint8).reshape(-1).numpy()
        step = -(-len(src_bytes) // threads)
        self._parts = [(dst_bytes[i : i + step], src_bytes[i : i + step]) for i in range(0, len(src_bytes), step)]
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="memcpy")
        self.streamed_available = pagecopy.copy_streamed(*self._parts[0])

    def plain(self) -> None:
        self.dst.copy_(self.src)

    def streamed(self) -> None:
        for _ in self._pool.map(lambda part: pagecopy.copy_streamed(*part), self._parts):
            pass

    def ways(self) -> dict[str, Callable[[], None]]:
        """name -> copy, for the ways this machine can run."""
        return {"memcpy": self.plain, "memcpy-nt": self.streamed} if self.streamed_available else {"memcpy": self.plain}

    def close(self) -> None:
        self._pool.shutdown()

ALIGN = 4096


class RawDisk:
    """Sequential page-sized writes with O_DIRECT then fdatasync, and O_DIRECT reads, of
    the same bytes on the filesystem the ssd tier uses."""

    def __init__(self, directory: Path, data: torch.Tensor, page_bytes: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "raw-disk.dat"
        self.page_bytes = page_bytes
        self.total = data.numel() * data.element_size()
        self.buf = mmap.mmap(-1, self.total)  # page aligned, as O_DIRECT needs
        memoryview(self.buf)[:] = memoryview(data.view(torch.uint8).reshape(-1).numpy())
        self.direct = hasattr(os, "O_DIRECT")
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError:
            self.direct = False
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def write(self) -> None:
        view = memoryview(self.buf)
        for off in range(0, self.total, self.page_bytes):
            os.pwrite(self.fd, view[off : off + self.page_bytes], off)
        os.fdatasync(self.fd)

    def read(self) -> None:
        view = memoryview(self.buf)
        for off in range(0, self.total, self.page_bytes):
            os.preadv(self.fd, [view[off : off + self.page_bytes]], off)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)
        self.buf.close()
