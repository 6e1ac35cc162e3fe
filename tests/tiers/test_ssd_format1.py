"""SSD pages written before page header format 2 (DESIGN §4: it added the generation): a tier
written by the old code (index entries with a parent key after the shorter header) opens,
lists its pages as generation 0, and reads them back."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kvstore.config import SsdTierConfig
from kvstore.page import HEADER_BYTES, HEADER_CORE_BYTES_V1, MAGIC, LayoutDesc, PageHeader, checksum
from kvstore.tiers import ssd_index
from kvstore.tiers.ssd import SsdTier

LAYOUT = LayoutDesc(2, 2, 2, 64, "float16", 16)
NS = b"format-1-ns-0000"


def _pack_v1(header: PageHeader) -> bytes:
    """A header as format 1 wrote it: no generation field."""
    lay = header.layout
    body = struct.pack("<4sHH16s16sIIII16sIQQ", MAGIC, 1, header.flags, header.namespace_id, header.key, lay.num_layers,
                       lay.kv_factor, lay.num_kv_heads, lay.head_dim, lay.dtype.encode(), lay.page_tokens,
                       header.payload_bytes, header.checksum)
    packed = body + struct.pack("<Q", checksum(body))
    return packed + bytes(HEADER_BYTES - len(packed))


def _open(tmp: Path) -> SsdTier:
    return SsdTier(SsdTierConfig(directory=tmp / "ssd", capacity_bytes=4 << 20, slab_bytes=1 << 20, dwpd=0))


def test_a_tier_the_old_format_wrote_opens_and_reads_as_generation_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = {bytes([i]) * 16: bytes([i]) * LAYOUT.page_bytes for i in range(1, 4)}
    headers = [PageHeader(NS, key, LAYOUT, len(data), checksum(data)) for key, data in payloads.items()]
    with monkeypatch.context() as old:  # the old code: format-1 headers on disk and in the index
        old.setattr(PageHeader, "pack", _pack_v1)
        old.setattr(ssd_index, "HEADER_CORE_BYTES", HEADER_CORE_BYTES_V1)
        tier = _open(tmp_path)
        for header, parent in zip(headers, [None, *[h.key for h in headers[:-1]]]):
            slot = tier.reserve(header.payload_bytes)
            assert slot is not None
            tier.write([(slot, header, memoryview(payloads[header.key]))])
            tier.commit([(slot, header)], [parent])
        tier.close()
    tier = _open(tmp_path)
    try:
        assert sorted(tier.recover()) == sorted((h.key, NS, h.payload_bytes, 0) for h in headers)
        for header in headers:
            buf = memoryview(bytearray(LAYOUT.page_bytes + 4096))
            assert tier.read_into([(header.key, buf)]).num_read == 1
            assert bytes(buf[: LAYOUT.page_bytes]) == payloads[header.key]
            assert tier.find(header.key)[1] == header  # generation 0
    finally:
        tier.close()
