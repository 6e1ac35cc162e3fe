"""A get over shared memory into KV that is not plain CPU rows (a ``PagedKV``, a device
tensor, a CPU tensor whose strides do not fold) lands only bytes it verified. The arena is
shared memory another process may write: ``ShmTransport.read_slot`` checksummed the slot and
then copied it into the engine's KV from a second read of the arena, so a writer that changed
the slot between the two reads landed bytes never verified, and the get reported success.
The arena here changes a page's bytes on every access after the first (as in
tests/client/adapters/test_leased_copy.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from support.changing_arena import ChangingArena
from support.kv import random_kv
from support.servers import make_config

from kvstore import KVLayout
from kvstore.client import KVStoreClient
from kvstore.client.engine_kv import PagedKV
from kvstore.client.transport.shm import ShmTransport
from kvstore.errors import KVStoreError
from kvstore.page import checksum

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_tokens=16)
PAGES = 3


def _landed(kv: PagedKV, page: int) -> np.ndarray:
    return torch.stack([kv.read_layer(page, layer) for layer in range(LAYOUT.num_layers)]).contiguous().view(torch.uint8).numpy()


def test_a_page_read_from_the_arena_lands_the_bytes_verified() -> None:
    pages = np.random.default_rng(3).integers(0, 256, (PAGES, LAYOUT.page_bytes), dtype=np.uint8)
    shm = ShmTransport(SimpleNamespace(layout=LAYOUT), arena=None, copy_threads=1)  # type: ignore[arg-type]
    try:
        blocks = [torch.zeros(8, 2, 16, 2, 8) for _ in range(LAYOUT.num_layers)]
        kv = PagedKV(blocks, [5, 1, 6], PAGES * 16, LAYOUT)
        for page in range(PAGES):
            arena: Any = ChangingArena(pages)
            acquired = SimpleNamespace(offset=page * LAYOUT.page_bytes, checksum=checksum(pages[page]))
            ok = shm.read_slot(kv, None, page, acquired, arena)
            if ok:  # reported good: it must hold exactly the verified bytes
                assert checksum(_landed(kv, page)) == acquired.checksum, f"page {page} landed bytes never verified"
    finally:
        shm._pool.shutdown()


FLIPPER = """
import mmap, os, sys, time
import numpy as np
fd = os.open(sys.argv[1], os.O_RDWR)
view = np.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size), dtype=np.uint8)[::4096]
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:  # each byte flipped and flipped back: the page is intact half the time
    view ^= 0xFF
    view ^= 0xFF
    time.sleep(0.00002)
"""


async def test_a_get_into_paged_kv_under_a_writer_of_the_arena_never_lands_wrong_bytes(server_factory, tmp_path: Path,
                                                                                         ns, layout) -> None:
    """Against a real server: another process maps the arena and toggles bytes while gets copy
    pages out into a PagedKV. A get may fail (PageCorrupt) or miss (the page quarantined), but
    one that succeeds holds exactly the pages that were put (before the fix: 122 of 1425 gets in
    15 s reported success with wrong bytes)."""
    server = server_factory(make_config(tmp_path, ssd_bytes=None))
    pages = 8
    tokens = list(range(pages * layout.page_tokens))
    kv = random_kv(layout, len(tokens), seed=1)
    want = torch.stack([kv[:, :, p * layout.page_tokens : (p + 1) * layout.page_tokens] for p in range(pages)])
    wrong = succeeded = 0
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, kv)
        flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, server.core.arena_of().path, "8"])  # noqa: ASYNC220 - started once
        try:
            end = time.monotonic() + 5
            while time.monotonic() < end:
                hit = await client.lookup(tokens)
                if hit.num_tokens < len(tokens):  # quarantined by a reader's report: put again
                    with contextlib.suppress(KVStoreError):
                        await client.put(tokens, kv)
                    continue
                blocks = [torch.zeros(pages, 2, layout.page_tokens, layout.num_kv_heads, layout.head_dim,
                                      dtype=layout.torch_dtype()) for _ in range(layout.num_layers)]
                into = PagedKV(blocks, list(range(pages))[::-1], len(tokens), layout)
                try:
                    await client.get(hit, into=into)
                except KVStoreError:
                    continue  # refused as corrupt: allowed
                succeeded += 1
                got = torch.stack([torch.stack([into.read_layer(p, i) for i in range(layout.num_layers)]) for p in range(pages)])
                wrong += not torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        finally:
            flipper.kill()
            flipper.wait()
    assert succeeded > 0
    assert wrong == 0, f"{wrong} of {succeeded} gets reported success with bytes that were never verified"
