"""A/B of the write side's one-read fix (CPU s per GB, process CPU time, alternating runs).

(a) ShmTransport.write_slot from KV that is not CPU rows (a PagedKV):
    before: page_in into the arena slot, then checksum(slot)
    after:  write_slot as it is now (page_in into a private staging page, copy_checksum_bytes into the slot)
(b) layer-wise save's copies (ContiguousKV and PagedKV):
    before: page[layer].copy_(read_layer) into the slots, then checksum(slot) of each page
    after:  save.LayerCopies (each layer gathered privately, copied into the slot and hashed in one pass)
Run: python -m kvstore.bench.ab.write_once [rounds] (DESIGN §8, the write side)"""

import mmap
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from kvstore import KVLayout
from kvstore.client.engine_kv import ContiguousKV, PagedKV
from kvstore.client.layerwise.save import LayerCopies
from kvstore.client.pages import slot_as_page
from kvstore.client.transport.contract import page_in
from kvstore.client.transport.shm import ShmTransport
from kvstore.page import checksum

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16, page_tokens=16)  # 2 MiB pages
PAGES = 64
N = LAYOUT.page_bytes


class Arena:
    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes)  # shared anonymous memory, as an arena
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        return torch.from_numpy(self.array[offset : offset + nbytes])


def paged(kv: torch.Tensor) -> PagedKV:
    tokens = kv.shape[2]
    blocks = tokens // LAYOUT.page_tokens
    table = list(np.random.default_rng(0).permutation(blocks))
    layers = [torch.empty(blocks, 2, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=kv.dtype)
              for _ in range(LAYOUT.num_layers)]
    for page, block in enumerate(table):
        for layer in range(LAYOUT.num_layers):
            layers[layer][block] = kv[layer, :, page * 16 : (page + 1) * 16]
    return PagedKV(layers, table, tokens, LAYOUT)


def write_before(shm, arena, kv) -> list[int]:
    out = []
    for page in range(PAGES):
        slot = arena.array[page * N : (page + 1) * N]
        page_in(slot_as_page(arena.slot(page * N, N), LAYOUT), kv, page, LAYOUT)
        out.append(checksum(slot))
    return out


def write_after(shm, arena, kv) -> list[int]:
    return [shm.write_slot(kv, None, page, page * N, arena) for page in range(PAGES)]


def save_before(arena, kv) -> list[int]:
    buffers = [arena.slot(p * N, N) for p in range(PAGES)]
    pages = [slot_as_page(b, LAYOUT) for b in buffers]
    for layer in range(LAYOUT.num_layers):
        for i, page in enumerate(pages):
            page[layer].copy_(kv.read_layer(i, layer))
    return [checksum(b.numpy()) for b in buffers]


def save_after(arena, kv) -> list[int]:
    copies = LayerCopies(kv, LAYOUT, 0, list(range(PAGES)), [arena.slot(p * N, N) for p in range(PAGES)])
    for layer in range(LAYOUT.num_layers):
        copies.copy(layer)
    return copies.checksums()


def cpu_s_per_gb(fn) -> tuple[float, list[int]]:
    start = time.process_time()
    sums = fn()
    return (time.process_time() - start) / (PAGES * N / 1e9), sums


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.set_num_threads(1)
    raw = (torch.randn(LAYOUT.num_layers, 2, PAGES * 16, LAYOUT.num_kv_heads, LAYOUT.head_dim) * 8).to(LAYOUT.dtype)
    contiguous, pkv = ContiguousKV(raw, LAYOUT), paged(raw)
    arena = Arena(PAGES * N)
    shm = ShmTransport(SimpleNamespace(layout=LAYOUT), arena=None, copy_threads=1)
    cases = {
        "write_slot PagedKV": (lambda: write_before(shm, arena, pkv), lambda: write_after(shm, arena, pkv)),
        "layerwise save ContiguousKV": (lambda: save_before(arena, contiguous), lambda: save_after(arena, contiguous)),
        "layerwise save PagedKV": (lambda: save_before(arena, pkv), lambda: save_after(arena, pkv)),
    }
    print(f"{PAGES} pages of {N >> 20} MiB, {LAYOUT.num_layers} layers, CPU s/GB (torch threads 1), {rounds} alternating rounds")
    for name, (before, after) in cases.items():
        before(), after()  # warm
        b_runs, a_runs = [], []
        for _ in range(rounds):
            b, sb = cpu_s_per_gb(before)
            a, sa = cpu_s_per_gb(after)
            assert sb == sa, "both builds must store the same checksums"
            b_runs.append(b)
            a_runs.append(a)
        print(f"{name:30s} before {min(b_runs):.3f}-{max(b_runs):.3f}  after {min(a_runs):.3f}-{max(a_runs):.3f}")
    shm._pool.shutdown()


if __name__ == "__main__":
    main()
