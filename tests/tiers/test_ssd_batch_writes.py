"""The SSD tier writes a batch of pages in adjacent slots (a demotion round's) with one
pwritev, not one a page: the demoter lets go of the GIL once a call, and a round's Python
between its disk writes is shorter. Counted where the kernel counts it (``syscw`` of
/proc/thread-self/io: this thread's write system calls). What is written reads back
verified; a page with a partial last block is written alone, zero-padded; nothing written
is found, before or after a restart, until it is committed.
"""

from __future__ import annotations

import itertools
import mmap
from pathlib import Path

import pytest

from kvstore.config import SsdTierConfig
from kvstore.page import LayoutDesc, PageHeader, checksum
from kvstore.tiers.ssd import SsdTier

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages
NS = b"ssd-batch-namesp"


def _write_calls() -> int:
    with open("/proc/thread-self/io", "rb") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(b"syscw:"))


def _page(i: int, size: int = LAYOUT.page_bytes) -> tuple[PageHeader, memoryview]:
    buf = mmap.mmap(-1, size + (-size) % 4096)  # page-aligned, as a landing slot is (O_DIRECT takes it as it is)
    buf[:size] = bytes([(i * 13 + j) % 251 for j in range(251)]) * (size // 251) + bytes(size % 251)
    payload = memoryview(buf)[:size]
    return PageHeader(NS, i.to_bytes(16, "big"), LAYOUT, size, checksum(payload)), payload


def _reserved(tier: SsdTier, pages: list[tuple[PageHeader, memoryview]]) -> list[tuple[int, PageHeader, memoryview]]:
    """A write batch of ``pages``, each in a slot reserved for it (in order: adjacent)."""
    return [(tier.reserve(header.payload_bytes), header, payload) for header, payload in pages]  # type: ignore[misc]


def _tier(tmp: Path, direct_io: bool) -> SsdTier:
    return SsdTier(SsdTierConfig(directory=tmp / "ssd", capacity_bytes=16 << 20, slab_bytes=4 << 20, direct_io=direct_io, dwpd=0))


def _reads_back(tier: SsdTier, pages: list[tuple[PageHeader, memoryview]]) -> None:
    bufs = [memoryview(mmap.mmap(-1, 64 << 10)) for _ in pages]
    result = tier.read_into([(header.key, buf) for (header, _), buf in zip(pages, bufs)])
    assert result.num_read == len(pages), result.reason
    for (header, payload), buf in zip(pages, bufs):
        assert bytes(buf[: header.payload_bytes]) == bytes(payload), header.key.hex()


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_batch_of_adjacent_slots_is_one_write_call_and_reads_back(tmp_path: Path, direct_io: bool) -> None:
    tier = _tier(tmp_path, direct_io)
    try:
        pages = [_page(i) for i in range(8)]
        batch = _reserved(tier, pages)
        slots = [slot for slot, _, _ in batch]
        assert all(b == a + tier.slot_bytes(LAYOUT.page_bytes) for a, b in itertools.pairwise(slots)), slots
        before = _write_calls()
        tier.write(batch[::-1])  # in any order
        assert _write_calls() - before == 1, "one write call a page, not one a batch"
        assert not any(tier.contains(header.key) for header, _ in pages), "found before its commit"
        tier.commit([(slot, header) for slot, header, _ in batch])
        _reads_back(tier, pages)
    finally:
        tier.close()


def test_a_partial_last_block_is_written_alone_zero_padded_and_the_rest_still_at_once(tmp_path: Path) -> None:
    tier = _tier(tmp_path, True)
    try:
        pages = [_page(0), _page(1), _page(2, LAYOUT.page_bytes - 1000), _page(3), _page(4)]
        batch = _reserved(tier, pages)
        before = _write_calls()
        tier.write(batch)
        assert _write_calls() - before <= 3  # pages 0-1, page 2 alone, pages 3-4
        tier.commit([(slot, header) for slot, header, _ in batch])
        _reads_back(tier, pages)
    finally:
        tier.close()


def test_a_batch_written_but_not_committed_is_not_found_after_a_restart(tmp_path: Path) -> None:
    tier = _tier(tmp_path, True)
    pages = [_page(i) for i in range(4)]
    try:
        tier.write(_reserved(tier, pages))
    finally:
        tier.close()  # a crash before the commit: the bytes are on disk, the index does not name them
    again = _tier(tmp_path, True)
    try:
        assert again.recover() == [] and not any(again.contains(header.key) for header, _ in pages)
        assert again.usage().used_bytes == 0, "the written slots are free again"
    finally:
        again.close()


def test_a_batch_larger_than_one_call_takes_is_written_in_several(tmp_path: Path) -> None:
    """A run of adjacent slots longer than ``run_bytes`` (a large durable put) goes in several
    calls, each within what one pwritev writes, and every page reads back."""
    tier = _tier(tmp_path, True)
    tier.run_bytes = 3 * tier.slot_bytes(LAYOUT.page_bytes)  # three pages a call
    try:
        pages = [_page(i) for i in range(8)]
        batch = _reserved(tier, pages)
        before = _write_calls()
        tier.write(batch)  # type: ignore[arg-type]
        assert _write_calls() - before == 3
        tier.commit([(slot, header) for slot, header, _ in batch])  # type: ignore[misc]
        _reads_back(tier, pages)
    finally:
        tier.close()
