"""The SSD tier holds pages of any byte size, not only multiples of 4 KiB:
an MLA latent page and an odd GQA page survive a durable put + SIGKILL + restart and a
demotion, bit-exact, with O_DIRECT and with buffered I/O."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.kv import random_kv
from support.servers import ServerProcess, make_config

from kvstore import KVLayout, Namespace
from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.client import KVStoreClient

LAYOUTS = {
    "mla": KVLayout(num_layers=3, num_kv_heads=1, head_dim=576, dtype=torch.bfloat16, page_tokens=16, attention="mla"),
    "odd-gqa": KVLayout(num_layers=3, num_kv_heads=3, head_dim=40, dtype=torch.float16, page_tokens=16),
}
IO_MODES = {"direct": (), "buffered": ("--no-direct-io",)}


@pytest.fixture(params=list(IO_MODES))
def io_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path, *IO_MODES[request.param])
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.proc.kill()
        proc.proc.wait(KILL_WAIT_S)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
@pytest.mark.parametrize("shape", list(LAYOUTS))
async def test_durable_put_of_odd_sized_pages_survives_sigkill(io_server, shape: str, use_shm: bool) -> None:
    """Bug: a page of 55,296 bytes (MLA, head_dim 576, 3 layers, bf16) failed a durable put
    with 'short write': write_slot checked the padded length for O_DIRECT but wrote the
    unpadded payload."""
    layout = LAYOUTS[shape]
    assert layout.page_bytes % 4096, "the point of the test: a page that is not whole 4 KiB blocks"
    ns = Namespace(model=f"odd-{shape}", revision="r", layout=layout)
    tokens = list(range(96))
    kv = random_kv(layout, 96, seed=21)
    io_server.start()
    async with KVStoreClient(io_server.address, ns, use_shm=use_shm) as client:
        assert await client.put(tokens, kv, durable=True) == 96
    io_server.kill()
    io_server.start()
    async with KVStoreClient(io_server.address, ns, use_shm=use_shm) as client:
        hit = await client.lookup(tokens)
        assert hit.num_tokens == 96 and {loc.tier for loc in hit.locations} == {"ssd"}
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
    assert io_server.terminate() == 0


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("shape", list(LAYOUTS))
async def test_odd_sized_pages_are_demoted_not_dropped(server_factory, tmp_path, shape: str, direct_io: bool) -> None:
    """Bug: demoting such a page failed the same way and the page was silently dropped:
    more pages than the host tier holds, put RAM-only, lost their evicted head."""
    import dataclasses

    layout = LAYOUTS[shape]
    ns = Namespace(model=f"odd-{shape}", revision="r", layout=layout)
    config = make_config(tmp_path, host_bytes=8 << 20)
    config = dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, direct_io=direct_io))
    server = server_factory(config)
    assert server.core.lower[0].direct_io is direct_io
    host_pages = server.core.view().tiers["host"].capacity_bytes // layout.page_bytes
    tokens = list(range(2 * host_pages * 16))
    kv = random_kv(layout, len(tokens), seed=22)
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv) == len(tokens)
        evicted = [k for k in client.keys(tokens) if "host" not in server.core.where(k)]  # the tail first
        assert len(evicted) >= host_pages, "half of the pages were evicted from the host tier"
        hit = await client.lookup(tokens)
        assert hit.num_tokens == len(tokens), "evicted pages were demoted to ssd"
        out = torch.zeros_like(kv)
        await client.get(hit, into=out)
        assert torch.equal(out, kv)
    assert server.core.stats().num_quarantined == 0


@pytest.mark.parametrize("aligned_source", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("size", [100, 4096, 3 * 4096 + 5, 55_296])
def test_write_slot_pads_any_page_size_with_zeros(tmp_path, size: int, direct_io: bool, aligned_source: bool) -> None:
    """Each slot write is header + payload padded to whole 4 KiB blocks with zeros (not
    stale bytes of an earlier page), from an aligned source without a copy or from any
    other buffer; the page reads back bit-exact after a restart of the tier."""
    import mmap
    import os

    from kvstore.config import SsdTierConfig
    from kvstore.page import HEADER_BYTES, LayoutDesc, PageHeader, checksum
    from kvstore.tiers.slab import round_up
    from kvstore.tiers.ssd import SsdTier

    config = SsdTierConfig(directory=tmp_path / "ssd", capacity_bytes=64 << 20, direct_io=direct_io)
    tier = SsdTier(config)
    assert tier.direct_io is direct_io
    source = mmap.mmap(-1, size + 4096 * 3)
    start = 0 if aligned_source else 8
    placed, pages = [], []
    for i, n in enumerate([size + 4096 + 7, size]):  # the second one after a longer one: its padding is zeros still
        payload = os.urandom(n)
        memoryview(source)[start : start + n] = payload
        header = PageHeader(b"n" * 16, i.to_bytes(16, "little"), LayoutDesc(1, 1, 1, n, "uint8", 1), n, checksum(payload))
        offset = tier.reserve(n)
        assert offset is not None
        tier.write([(offset, header, memoryview(source)[start : start + n])])
        placed.append((offset, header))
        pages.append(payload)
    tier.commit(placed)
    tier.close()
    with open(tmp_path / "ssd" / "pages.dat", "rb") as f:
        for (offset, _), payload in zip(placed, pages):
            f.seek(offset + HEADER_BYTES)
            assert f.read(round_up(len(payload))) == payload + bytes(round_up(len(payload)) - len(payload))
    tier = SsdTier(config)
    try:
        for i, payload in enumerate(pages):
            into = bytearray(len(payload))
            assert tier.read_into([(i.to_bytes(16, "little"), memoryview(into))]).num_read == 1 and bytes(into) == payload
    finally:
        tier.close()
