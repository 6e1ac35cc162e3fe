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
