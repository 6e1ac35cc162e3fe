"""Copying page bytes and computing their checksum in one pass.

Every page that enters or leaves the shared-memory arena is copied once and checksummed
once. Done apart, the checksum reads the bytes a second time; the native
``kvstore._copyhash`` hashes each piece while it is in L1 and streams it to its
destination, which is ~1.4x faster on a 2-core host. Without the extension (no C
compiler at install) numpy does the same work: same bytes, same checksum.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.page import checksum, checksum_rows, checksummer

logger = logging.getLogger(__name__)

NATIVE_MISSING = ""  # why the native half is not in use (said in the server's start line)
try:
    from kvstore import _copyhash

    NATIVE = True
except ImportError as exc:  # no compiler at install time, or an xxhash build without the XXH3 exports
    _copyhash = None  # type: ignore[assignment]
    NATIVE = False
    NATIVE_MISSING = f"kvstore._copyhash unavailable ({exc}); reinstall with a C compiler present"
    logger.info("page copies use numpy: %s", NATIVE_MISSING)


def copy_checksum_bytes(dst: Any, src: Any) -> int:
    """``copy_checksum`` for two contiguous buffers of one length (a staged page and its
    slot, a received chunk and its slot)."""
    return copy_checksum(np.frombuffer(dst, dtype=np.uint8).reshape(1, -1), np.frombuffer(src, dtype=np.uint8).reshape(1, -1))


def copy_streamed(dst: Any, src: Any) -> bool:
    """Copies ``src`` into ``dst`` (contiguous buffers of one length) with the non-temporal
    stores ``copy_checksum`` writes slots with, without hashing; False (nothing copied)
    without the native half. Benchmarks compare a streamed path with it."""
    if not NATIVE or _copyhash is None:
        return False
    _copyhash.copy_streamed(dst, src)
    return True


def frame_checksummed(head: bytes, rows: np.ndarray, tag: int) -> tuple[bytes, int]:
    """``head`` + the bytes of ``rows`` (2-D uint8, rows contiguous) + ``tag`` + their checksum
    as a 10-byte varint, built in one pass; returns the message and the checksum. Lets a
    sender put a page's checksum into its message without reading the page twice."""
    if NATIVE and _copyhash is not None:
        message, digest = _copyhash.frame_checksummed(head, rows, tag)
        return message, int(digest)
    digest = checksum_rows(rows)
    varint = bytes([((digest >> (7 * i)) & 0x7F) | 0x80 for i in range(9)]) + bytes([digest >> 63])
    return b"".join((head, *(memoryview(row) for row in rows), bytes([tag]), varint)), digest


def copy_checksum(dst: np.ndarray, src: np.ndarray, native: bool = NATIVE) -> int:
    """Copies ``src`` into ``dst`` and returns ``kvstore.page.checksum`` of the bytes, row
    after row. Both are 2-D uint8 arrays of one shape whose rows are contiguous (a page in
    the arena reshaped to the engine's rows, or an engine page's strided rows). The GIL is
    released while the bytes move. Each byte of ``src`` is read once and the digest is of
    the bytes written: a writer changing ``src`` meanwhile cannot land bytes never hashed."""
    if native and _copyhash is not None:
        return int(_copyhash.copy_checksum(dst, src))
    private = np.ascontiguousarray(src) if not src.flags.c_contiguous else src.copy()  # src is read once:
    np.copyto(dst, private)  # it may be shared memory another process writes (an arena slot); what is
    return checksum(private)  # hashed is what lands, and dst may be shared too


def checksum_released(data: Any) -> int:
    """``kvstore.page.checksum`` of a contiguous buffer, hashed with the GIL released (the
    native half; xxhash's one-shot call holds it). A 2.25 MiB page takes 0.2-0.4 ms to hash:
    verified beside a disk write under the GIL, every page demoted held a lookup up that long."""
    if NATIVE and _copyhash is not None:
        state = _copyhash.Checksum()
        state.update(data)
        return int(state.intdigest())
    return checksum(data)


def running_checksum(native: bool = NATIVE) -> Any:
    """A running page checksum (``update``, ``intdigest``) that ``scatter_checksum`` feeds:
    the native one where it is built, else xxhash's (same digest)."""
    return _copyhash.Checksum() if native and _copyhash is not None else checksummer()


def scatter_checksum(sums: Sequence[Any], dst: np.ndarray, offsets: Sequence[int], strides: Sequence[int],
                     shape: Sequence[int], srcs: Sequence[Any], native: bool = NATIVE) -> None:
    """For each i, copies ``srcs[i]`` (``prod(shape)`` contiguous bytes, read in C order)
    to its place in ``dst`` (a 1-D uint8 array): from byte ``offsets[i]`` on, laid out by
    ``shape`` (the last entry: bytes of one contiguous run) and ``strides`` (bytes, one per
    dimension before the last), and feeds the bytes to ``sums[i]`` (``running_checksum``).
    A layer of every page of a load is one call, read once: each piece is hashed from the
    copy it was loaded into, so a writer changing ``srcs`` meanwhile cannot land bytes never
    hashed. Every place is checked to lie inside ``dst`` first. The GIL is
    released while the bytes move."""
    if native and _copyhash is not None:
        _copyhash.scatter_checksum(sums, dst, offsets, strides, shape, srcs)
        return
    if not len(sums) == len(offsets) == len(srcs):
        raise ValueError("checksums, offsets and srcs must have one length")
    extent = shape[-1] + sum((n - 1) * stride for n, stride in zip(shape, strides))
    if min(offsets, default=0) < 0 or max(offsets, default=0) > len(dst) - extent or min((*shape, *strides), default=0) < 0:
        raise ValueError(f"a place of {extent} bytes lies outside dst ({len(dst)} bytes)")
    for running, offset, src in zip(sums, offsets, srcs):
        place = np.lib.stride_tricks.as_strided(dst[offset:], shape=tuple(shape), strides=(*strides, 1))
        data = np.frombuffer(src, dtype=np.uint8).reshape(shape).copy()  # src read once: it may be shared memory
        np.copyto(place, data)
        running.update(data)
