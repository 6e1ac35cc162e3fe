"""The fused page copy + checksum: the native path and the numpy path give the same bytes
and the same checksum as ``kvstore.page.checksum``, for pages written into the arena
(strided engine rows -> contiguous slot) and read out of it (slot -> strided rows)."""

from __future__ import annotations

import subprocess
import sys
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


@pytest.mark.parametrize("native", PATHS)
def test_a_source_changing_under_the_copy_lands_only_hashed_bytes(native: bool) -> None:
    """The source may be an arena slot another process writes while a reader copies it out:
    the digest returned is the digest of the bytes that landed, whatever the writer does
    (hashing the source and then copying it from a second read let flipped bytes land
    unhashed: 123 of 300 copies of a 4 MiB page did before the copy was hashed)."""
    src = np.ascontiguousarray(_rows(5, rows=1, run=1 << 20, pages=4))
    dst = np.empty_like(src)
    stop = threading.Event()

    def flip() -> None:
        view = src.reshape(-1)
        while not stop.is_set():
            view[::4096] += 1

    writer = threading.Thread(target=flip)
    writer.start()
    try:
        wrong = sum(pagecopy.copy_checksum(dst, src, native=native) != checksum(dst) for _ in range(100))
        flat = dst.reshape(-1)
        for _ in range(100):  # the layer-wise load's scatter: runs of 4 KiB into every other place
            running = pagecopy.running_checksum(native)
            pagecopy.scatter_checksum([running], flat, [0], [8192], [src.size // 8192, 4096], [src.reshape(-1)[: src.size // 2]],
                                      native=native)
            landed = np.lib.stride_tricks.as_strided(flat, shape=(src.size // 8192, 4096), strides=(8192, 1))
            wrong += running.intdigest() != checksum(np.ascontiguousarray(landed))
        message, digest = pagecopy.frame_checksummed(b"head", src, 0x3A)
        framed = np.frombuffer(message, dtype=np.uint8)[4 : 4 + src.size]
    finally:
        stop.set()
        writer.join()
    assert wrong == 0
    if native:
        assert digest == checksum(framed)


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


def _scatter_case(seed: int) -> tuple[np.ndarray, np.ndarray, list[int], tuple[int, ...], tuple[int, ...]]:
    """Two [kv, tokens, heads, dim-bytes] pieces scattered into a paged, head-major buffer
    [blocks, heads, kv, block tokens, dim-bytes], as vLLM's CPU cache holds them."""
    blocks, heads, block_tokens, run, tokens = 3, 4, 8, 40, 4
    dst = np.zeros(blocks * heads * 2 * block_tokens * run + 5, dtype=np.uint8)
    src = np.random.default_rng(seed).integers(0, 256, (2, 2 * tokens * heads * run), dtype=np.uint8)
    strides = (block_tokens * run, run, 2 * block_tokens * run)  # kv, token, head
    block = heads * 2 * block_tokens * run
    offsets = [5 + 2 * block + 4 * run, 5 + 0 * block]  # (block 2, token 4) and (block 0, token 0), unaligned
    return dst, src, offsets, strides, (2, tokens, heads, run)


@pytest.mark.parametrize("native", PATHS)
def test_scatter_checksum_places_the_bytes_and_hashes_them(native: bool) -> None:
    """Every page in one call: each source lands in its strided place, nothing else is
    written, and each running checksum equals kvstore.page.checksum of its source, also
    when it is fed across two calls (K in the first, V in the second, as layer after layer)."""
    dst, src, offsets, strides, shape = _scatter_case(5)
    sums = [pagecopy.running_checksum(native) for _ in offsets]
    half = src.shape[1] // 2
    for kv in (0, 1):
        pagecopy.scatter_checksum(sums, dst, [o + kv * strides[0] for o in offsets], strides[1:], shape[1:],
                                  [s[kv * half : (kv + 1) * half] for s in src], native=native)
    assert [s.intdigest() for s in sums] == [checksum(s) for s in src]
    placed = np.zeros_like(dst)
    for o, s in zip(offsets, src):
        np.lib.stride_tricks.as_strided(placed[o:], shape=shape, strides=(*strides, 1))[...] = s.reshape(shape)
    assert np.array_equal(dst, placed)


def test_native_scatter_refuses_places_outside_the_buffer() -> None:
    """Every place is checked before a byte moves: a clear error, never a write out of bounds."""
    dst, src, offsets, strides, shape = _scatter_case(6)
    sums = [pagecopy.running_checksum() for _ in offsets]
    for native in (True, False):
        with pytest.raises(ValueError):
            pagecopy.scatter_checksum(sums, dst, [len(dst) - 10, 0], strides, shape, list(src), native=native)
        with pytest.raises((ValueError, OverflowError)):
            pagecopy.scatter_checksum(sums, dst, [-1, 0], strides, shape, list(src), native=native)
    assert not dst.any()
    with pytest.raises(ValueError, match="has 1279 bytes"):
        pagecopy.scatter_checksum(sums, dst, offsets, strides, shape, [src[0][:-1], src[1]])
    with pytest.raises(TypeError, match="Checksum"):
        pagecopy.scatter_checksum([pagecopy.running_checksum(False)] * 2, dst, offsets, strides, shape, list(src))
    readonly = dst.copy()
    readonly.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        pagecopy.scatter_checksum(sums, readonly, offsets, strides, shape, list(src))
    with pytest.raises(OverflowError):  # a place so large that its size wraps around is refused, not written
        pagecopy.scatter_checksum(sums, dst, offsets, (1 << 62, 1, 1), (4, 1 << 62, 1, 1), list(src))


_SHARED_CHECKSUM = """
import sys, threading, time
import numpy as np
from kvstore._copyhash import Checksum, scatter_checksum
sys.setswitchinterval(1e-6)
shared = Checksum()
bufs = [np.ones(n, np.uint8) for n in (1, 63, 200, 255, 1000, 5000)]
dst = np.zeros(5000, np.uint8)
refused = [0]
stop = threading.Event()
def feed(i):
    while not stop.is_set():
        i += 1
        try:
            if i % 3:
                shared.update(bufs[i % len(bufs)])
            else:
                scatter_checksum([shared], dst, [0], (), (len(bufs[i % len(bufs)]),), [bufs[i % len(bufs)]])
            shared.intdigest()
        except RuntimeError:
            refused[0] += 1
threads = [threading.Thread(target=feed, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
time.sleep(float(sys.argv[1]))
stop.set()
for t in threads:
    t.join()
print("refused", refused[0])
"""


def test_a_checksum_fed_from_two_threads_at_once_is_refused_not_corrupted() -> None:
    """Bug: Checksum.update and scatter_checksum feed the xxh3 state with the GIL released and
    nothing kept two threads off one state: Python code feeding a Checksum from several
    threads crashed the process (SIGSEGV: the state's buffer overrun). A second feeder now
    gets RuntimeError. Run in a child: on the unchanged code it dies."""
    child = subprocess.run([sys.executable, "-c", _SHARED_CHECKSUM, "3"], check=False, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, f"the child died (rc {child.returncode}): {child.stderr[-500:]}"
    assert int(child.stdout.split()[-1]) > 0, "no concurrent feed was refused"
