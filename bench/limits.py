"""Raw disk, the limit the SSD paths chase: O_DIRECT page writes + fdatasync and O_DIRECT
reads of the same bytes on the same filesystem. (memcpy is timed inline by the throughput
benchmark; the raw gRPC pump is rawgrpc.py.)"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

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
