"""The SSD tier's writes: header and payload into a reserved slot, the payload's whole 4 KiB
blocks straight from where they lie (O_DIRECT when they are aligned), a batch of adjacent
slots in one pwritev. Nothing written here is durable nor indexed before ``commit``
(ssd.py). Mixed into ``ssd.SsdTier``, whose reads share the aligned per-thread buffers."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

from kvstore.page import HEADER_BYTES, PageHeader
from kvstore.tiers.slab import ALIGN, round_up
from kvstore.tiers.ssd_index import slot_bytes

DATA_FILE = "pages.dat"
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one pwritev takes


def _address(view: memoryview) -> int | None:
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class SsdWrites:
    run_bytes = 256 << 20  # at most this much a call (Linux writes at most 2 GiB in one; a large durable put is several)
    fd: int
    direct_io: bool
    _local: threading.local

    # -- scratch buffers (aligned, per thread) -------------------------------------------

    def _scratch(self, nbytes: int) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = mmap.mmap(-1, round_up(max(nbytes, 4 << 20)))
            self._local.buf = buf
        return buf

    def _header_buf(self) -> mmap.mmap:
        buf = getattr(self._local, "hdr", None)
        if buf is None:
            buf = self._local.hdr = mmap.mmap(-1, HEADER_BYTES)
        return buf

    def _direct_ok(self, view: memoryview, nbytes: int) -> bool:
        addr = _address(view)
        return addr is not None and addr % ALIGN == 0 and nbytes % ALIGN == 0

    def _write_one(self, slot: int, header: PageHeader, payload: memoryview) -> None:
        """Writes header and payload, zero-padded to whole 4 KiB blocks, into a reserved slot
        (not yet durable nor indexed). The payload's whole blocks go to disk without a copy
        (for O_DIRECT when they are aligned); only the rest is staged."""
        hdr = self._header_buf()
        hdr[:] = header.pack()
        size = header.payload_bytes
        whole = size - size % ALIGN
        if self.direct_io and not self._direct_ok(payload, whole):
            whole = 0
        bufs: list[object] = [hdr, payload[:whole]]
        if whole < size:
            staged = memoryview(self._scratch(size - whole))[: round_up(size - whole)]
            staged[: size - whole] = payload[whole:size]
            staged[size - whole :] = bytes(len(staged) - (size - whole))  # zeros, not an earlier page's bytes
            bufs.append(staged)
        written = os.pwritev(self.fd, bufs, slot)  # type: ignore[arg-type]
        if written != slot_bytes(size):
            raise OSError(f"short write to {DATA_FILE}: {written} of {slot_bytes(size)} bytes")

    def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        """Writes a batch: the pages of adjacent slots (a slab hands its slots out in
        order) go in one pwritev, so that a batch of 32 MiB is a call or two to the device,
        the GIL let go once a call instead of once a page (the background demoter hands its
        rounds over in smaller batches: placement/background.py). A page whose payload
        cannot go to disk as it is (a partial last block, or unaligned for O_DIRECT) is
        written alone, by ``_write_one``."""
        headers = self._header_bufs(len(pages))
        bufs: list[object] = []
        start = end = 0
        for index, (slot, header, payload) in enumerate(sorted(pages, key=lambda page: page[0])):
            size = header.payload_bytes
            if size % ALIGN or (self.direct_io and not self._direct_ok(payload, size)):
                self._write_one(slot, header, payload)
                continue
            if slot != end or len(bufs) + 2 > IOV_MAX or end - start + HEADER_BYTES + size > self.run_bytes:
                self._pwrite(bufs, start, end)
                bufs, start = [], slot
            hdr = headers[index * HEADER_BYTES : (index + 1) * HEADER_BYTES]
            hdr[:] = header.pack()
            bufs += (hdr, payload[:size])
            end = slot + HEADER_BYTES + size
        self._pwrite(bufs, start, end)

    def _header_bufs(self, count: int) -> memoryview:
        """``count`` aligned header blocks (per thread, grown as needed)."""
        buf = getattr(self._local, "hdrs", None)
        if buf is None or len(buf) < count * HEADER_BYTES:
            buf = self._local.hdrs = mmap.mmap(-1, max(count, 64) * HEADER_BYTES)
        return memoryview(buf)

    def _pwrite(self, bufs: list[object], start: int, end: int) -> None:
        if not bufs:
            return
        written = os.pwritev(self.fd, bufs, start)  # type: ignore[arg-type]
        if written != end - start:
            raise OSError(f"short write to {DATA_FILE}: {written} of {end - start} bytes")
