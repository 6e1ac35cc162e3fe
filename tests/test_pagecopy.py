"""The fused page copy + checksum: the native path and the numpy path give the same bytes
and the same checksum as ``kvstore.page.checksum``, for pages written into the arena
(strided engine rows -> contiguous slot) and read out of it (slot -> strided rows)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore import pagecopy
from kvstore.page import checksum

PATHS = [pytest.param(False, id="numpy"), pytest.param(True, id="native")]


def test_the_native_path_is_built() -> None:
    """setup.py builds kvstore._copyhash wherever a C compiler exists (as here and in CI);
    without it, clients fall back silently, so this says when the fast path went missing."""
    assert pagecopy.NATIVE, "kvstore._copyhash did not build or import; page copies use numpy"


def _rows(seed: int, rows: int = 9, run: int = 20_011, pages: int = 3) -> np.ndarray:
    """Engine-like rows: each page is a column window of every row (odd sizes on purpose:
    unaligned starts and tails)."""
    return np.random.default_rng(seed).integers(0, 256, (rows, run * pages), dtype=np.uint8)


@pytest.mark.parametrize("native", PATHS)
def test_rows_into_a_slot_and_back(native: bool) -> None:
    rows, run = _rows(1), 20_011
    page = rows[:, run : 2 * run]
    arena = np.zeros(rows.shape[0] * run + 7, dtype=np.uint8)
    slot = arena[7:].reshape(rows.shape[0], run)  # an unaligned slot
    digest = pagecopy.copy_checksum(slot, page, native=native)
    assert np.array_equal(slot, page)
    assert digest == checksum(np.ascontiguousarray(page))
    assert not arena[:7].any(), "nothing written before the slot"

    out = np.zeros_like(rows)
    assert pagecopy.copy_checksum(out[:, run : 2 * run], slot, native=native) == digest
    assert np.array_equal(out[:, run : 2 * run], page)
    assert not out[:, :run].any() and not out[:, 2 * run :].any(), "nothing written outside the page"


@pytest.mark.parametrize("native", PATHS)
def test_a_changed_byte_changes_the_checksum(native: bool) -> None:
    slot = np.ascontiguousarray(_rows(2)[:, :4096])
    good = checksum(slot)
    slot[3, 17] ^= 1
    assert pagecopy.copy_checksum(np.empty_like(slot), slot, native=native) != good


def test_native_rejects_mismatched_or_unusable_arrays() -> None:
    """A clear error, never a write out of bounds (numpy broadcasts instead; the client only
    passes matching shapes)."""
    src = _rows(3)[:, :100]
    with pytest.raises(ValueError, match="is 9x100 bytes but src is 9x99"):
        pagecopy.copy_checksum(np.empty((9, 100), np.uint8), src[:, :99])
    with pytest.raises(ValueError, match="2-D byte array"):
        pagecopy.copy_checksum(np.empty(900, np.uint8), src)
    with pytest.raises(ValueError, match="contiguous rows"):
        pagecopy.copy_checksum(np.empty((9, 50), np.uint8), src[:, ::2])
    with pytest.raises((TypeError, BufferError, ValueError)):
        pagecopy.copy_checksum(np.empty((9, 100), np.uint8)[:, :], bytes(900))  # not 2-D
    readonly = np.empty((9, 100), np.uint8)
    readonly.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        pagecopy.copy_checksum(readonly, src)


def test_native_copies_from_many_threads_are_right() -> None:
    """The GIL is released while bytes move and every call has its own hash state: copies
    on the client's copy threads at once each get their own page's digest."""
    rows = _rows(4, rows=16, run=65_536, pages=4)
    run = 65_536
    want = [checksum(np.ascontiguousarray(rows[:, p * run : (p + 1) * run])) for p in range(4)]
    got: dict[int, int] = {}

    def copy(p: int) -> None:
        got[p] = pagecopy.copy_checksum(np.empty((16, run), np.uint8), rows[:, p * run : (p + 1) * run])

    threads = [threading.Thread(target=copy, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[p] for p in range(4)] == want
