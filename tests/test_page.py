"""The page header and checksum: a damaged page is recognised, never trusted."""

from __future__ import annotations

import pytest

from kvstore.errors import PageCorrupt
from kvstore.page import HEADER_BYTES, LayoutDesc, PageHeader, checksum

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)


def _header(payload: bytes) -> PageHeader:
    return PageHeader(b"n" * 16, b"k" * 16, LAYOUT, len(payload), checksum(payload))


def test_roundtrip() -> None:
    payload = bytes(range(256)) * 64
    header = _header(payload)
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert PageHeader.unpack(packed) == header
    header.verify_payload(payload, len(payload))


@pytest.mark.parametrize("pos", [0, 5, 20, 40, 70, 99])
def test_flipped_header_byte_is_detected(pos: int) -> None:
    packed = bytearray(_header(b"x" * 4096).pack())
    packed[pos] ^= 0x40
    with pytest.raises(PageCorrupt):
        PageHeader.unpack(bytes(packed))


def test_payload_checks() -> None:
    payload = bytearray(b"y" * 8192)
    header = _header(bytes(payload))
    with pytest.raises(PageCorrupt, match="bytes"):
        header.verify_payload(payload[:-1], len(payload) - 1)
    payload[4000] ^= 1
    with pytest.raises(PageCorrupt, match="checksum"):
        header.verify_payload(payload, len(payload))


def test_wire_roundtrip_and_damage() -> None:
    """Chunks made by kvstore.wire go back together only whole, in order, and intact."""
    from kvstore._proto import common_pb2
    from kvstore.client.wire import PageAssembler
    from kvstore.wire import page_chunks

    data = bytes(range(256)) * 64  # 16 KiB
    layout = common_pb2.Layout(num_layers=1, kv_factor=2, num_kv_heads=1, head_dim=64, dtype="float16", page_tokens=64)
    chunks = list(page_chunks(b"k" * 16, b"n" * 16, layout, memoryview(data), checksum(data), chunk_bytes=4096))
    assert len(chunks) == 4 and chunks[0].namespace_id and not chunks[1].namespace_id
    asm = PageAssembler([b"k" * 16], len(data))
    pages = [p for p in (asm.feed(c) for c in chunks) if p is not None]
    assert len(pages) == 1 and bytes(pages[0].numpy()) == data
    with pytest.raises(PageCorrupt, match="out-of-order"):
        PageAssembler([b"k" * 16], len(data)).feed(chunks[1])
    bad = list(chunks)
    bad[2] = type(bad[2])(**{f.name: getattr(bad[2], f.name) for f in bad[2].DESCRIPTOR.fields if f.name != "data"},
                          data=b"\0" * 4096)
    asm = PageAssembler([b"k" * 16], len(data))
    with pytest.raises(PageCorrupt, match="checksum"):
        for c in bad:
            asm.feed(c)
