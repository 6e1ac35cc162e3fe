"""The page header and checksum: a damaged page is recognised, never trusted."""

from __future__ import annotations

import struct

import pytest

from kvstore.errors import InvalidRequest, PageCorrupt
from kvstore.page import HEADER_BYTES, LayoutDesc, PageHeader, checksum, core_bytes, peek_generation

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


def test_the_generation_is_kept_and_a_format_1_header_reads_as_generation_0() -> None:
    """Format 2 carries the namespace's generation (DESIGN §12.4); pages written before it (format
    1, no such field) stay readable, as generation 0."""
    header = PageHeader(b"n" * 16, b"k" * 16, LAYOUT, 4096, 7, flags=1, generation=2**40 + 3)
    packed = header.pack()
    assert PageHeader.unpack(packed) == header and peek_generation(packed) == 2**40 + 3
    body = struct.pack("<4sHH16s16sIIII16sIQQ", b"KVPG", 1, 1, b"n" * 16, b"k" * 16, 4, 2, 2, 64, b"float16", 16, 4096, 7)
    v1 = body + struct.pack("<Q", checksum(body))
    assert core_bytes(v1) == len(v1) < core_bytes(packed)
    assert PageHeader.unpack(v1) == PageHeader(b"n" * 16, b"k" * 16, LAYOUT, 4096, 7, flags=1, generation=0)
    assert peek_generation(v1) == 0


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
    """Chunks made by kvstore.page_wire.grpc_chunks go back together only whole, in order, and intact."""
    from kvstore._proto import common_pb2
    from kvstore.client.page_assembler import PageAssembler
    from kvstore.page_wire.grpc_chunks import decode_chunk, page_chunks

    data = bytes(range(256)) * 64  # 16 KiB
    layout = common_pb2.Layout(num_layers=1, kv_factor=2, num_kv_heads=1, head_dim=64, dtype="float16", page_tokens=64)
    chunks = [decode_chunk(raw) for raw in page_chunks(b"k" * 16, b"n" * 16, layout, memoryview(data), checksum(data), chunk_bytes=4096)]
    assert len(chunks) == 4 and chunks[0].namespace_id and not chunks[1].namespace_id
    asm = PageAssembler([b"k" * 16], len(data))
    assert [asm.feed(c) for c in chunks] == [False, False, False, True] and bytes(asm.page.numpy()) == data
    with pytest.raises(PageCorrupt, match="out-of-order"):
        PageAssembler([b"k" * 16], len(data)).feed(chunks[1])
    bad = list(chunks)
    bad[2] = type(bad[2])(bad[2].meta, memoryview(b"\0" * 4096))
    asm = PageAssembler([b"k" * 16], len(data))
    with pytest.raises(PageCorrupt, match="checksum"):
        for c in bad:
            asm.feed(c)


def test_target_pages_that_fail_or_stay_unfinished_are_zeroed() -> None:
    """Into an engine's rows (the ``target``), chunk by chunk and whole: a page that fails
    its checksum, and one the stream leaves half written (``abandon``), are zeroed; the
    pages before them stay."""
    import numpy as np

    from kvstore._proto import common_pb2
    from kvstore.client.page_assembler import PageAssembler
    from kvstore.client.pages import KVRows
    from kvstore.page_wire.grpc_chunks import decode_chunk, page_chunks

    layout = common_pb2.Layout(num_layers=1, kv_factor=2, num_kv_heads=1, head_dim=64, dtype="float16", page_tokens=64)
    pages = [bytes([i + 1]) * 16384 for i in range(2)]  # two 16 KiB pages of 2 rows
    keys = [b"a" * 16, b"b" * 16]

    def encoded(i: int, chunk_bytes: int, damage: bool = False) -> list:
        data = pages[i] if not damage else pages[i][:-1] + b"\0"
        return [decode_chunk(raw) for raw in page_chunks(keys[i], b"n" * 16, layout, memoryview(data), checksum(pages[i]),
                                                         chunk_bytes=chunk_bytes)]

    for chunk_bytes in (4096, 16384):  # several chunks per page / the page in one chunk
        rows = KVRows(np.zeros((2, 2 * 8192), dtype=np.uint8), 8192)
        asm = PageAssembler(keys, 16384, target=rows.page)
        assert [asm.feed(c) for c in encoded(0, chunk_bytes)][-1]
        with pytest.raises(PageCorrupt, match="checksum"):
            for c in encoded(1, chunk_bytes, damage=True):
                asm.feed(c)
        assert rows.page(0).rows.tobytes() == pages[0]
        assert not rows.page(1).rows.any(), "the damaged page's bytes must not stay in the engine's tensor"

    rows = KVRows(np.zeros((2, 2 * 8192), dtype=np.uint8), 8192)
    asm = PageAssembler(keys, 16384, target=rows.page)
    first, *_ = encoded(0, 4096)
    assert not asm.feed(first) and rows.page(0).rows.any()
    asm.abandon()  # the stream broke off after one chunk
    assert not rows.page(0).rows.any()


def test_chunk_codec_is_protobuf() -> None:
    """An encoded chunk is a PageChunk to protobuf, and decode_chunk reads protobuf's own
    encoding (fields in number order, data in the middle) the same way."""
    from kvstore._proto import common_pb2, data_pb2
    from kvstore.page_wire.grpc_chunks import decode_chunk, page_chunks

    data = bytes(range(256)) * 40
    layout = common_pb2.Layout(num_layers=1, kv_factor=2, num_kv_heads=1, head_dim=20, dtype="float16", page_tokens=64)
    raw = next(page_chunks(b"k" * 16, b"n" * 16, layout, memoryview(data), 1234, durable=True))
    msg = data_pb2.PageChunk.FromString(raw)
    assert (msg.key, msg.namespace_id, msg.layout, msg.page_bytes, msg.checksum, msg.offset, msg.data, msg.durable) == (
        b"k" * 16, b"n" * 16, layout, len(data), 1234, 0, data, True)
    back = decode_chunk(msg.SerializeToString())
    assert back.error is None and back.meta == data_pb2.PageChunk(
        key=b"k" * 16, namespace_id=b"n" * 16, layout=layout, page_bytes=len(data), checksum=1234, durable=True)
    assert bytes(back.data) == data
    for garbage in (b"\xff" * 12, raw[:100], b"\x3a\x80\x80\x80\x80\x10"):
        assert "malformed PageChunk" in (decode_chunk(garbage).error or "")


def test_row_page_matches_the_page_bytes() -> None:
    """RowPage reads and writes a page of an engine tensor (here a strided slice) exactly as
    the layer-major page bytes, at any offsets, and checksums them the same way."""
    import torch

    from kvstore import KVLayout
    from kvstore.client.pages import page_of, page_rows

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=24, dtype=torch.float16, page_tokens=4)
    big = torch.randn(3, 2, 20, 2, 24).to(torch.float16)
    kv = big[:, :, :12]  # not contiguous: the rows have a stride of 20 tokens
    rows = page_rows(kv, layout)
    assert rows is not None and rows.run == layout.page_bytes // 6
    run = rows.run
    want = page_of(kv, 1, 4).contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    page = rows.page(1)
    assert b"".join(bytes(p) for p in page.pieces(0, page.nbytes)) == want
    assert b"".join(bytes(p) for p in page.pieces(100, 1000)) == want[100:1000]
    assert page.checksum() == checksum(want)
    fresh = torch.zeros_like(big)[:, :, :12]
    out = page_rows(fresh, layout).page(1)
    for start, end in ((0, 700), (700, 768), (768, 2 * run), (2 * run, len(want))):  # odd cuts, then whole rows
        out.write(start, memoryview(want[start:end]))
    assert torch.equal(page_of(fresh, 1, 4), page_of(kv, 1, 4)) and not fresh[:, :, :4].any()
    assert page_rows(kv.transpose(3, 4), layout) is None  # heads/dim not contiguous: no row view


@pytest.mark.parametrize("native", [True, False])
def test_a_sender_without_the_checksum_gets_it_computed_into_the_message(monkeypatch, native: bool) -> None:
    """``page_chunks`` with no checksum: a one-chunk page gets its checksum written after its
    bytes (one pass, native or numpy alike), a longer page gets it in every chunk; protobuf
    and decode_chunk read the same message, from a buffer or from an engine's strided rows."""
    import numpy as np

    from kvstore import pagecopy
    from kvstore._proto import common_pb2, data_pb2
    from kvstore.client.pages import KVRows
    from kvstore.page_wire.grpc_chunks import decode_chunk, page_chunks

    if native and not pagecopy.NATIVE:
        pytest.skip(pagecopy.NATIVE_MISSING)
    monkeypatch.setattr(pagecopy, "NATIVE", native)
    layout = common_pb2.Layout(num_layers=1, kv_factor=2, num_kv_heads=1, head_dim=64, dtype="float16", page_tokens=64)
    engine = np.random.default_rng(7).integers(0, 256, size=(2, 3 * 8192), dtype=np.uint8)  # rows of 3 pages
    page = KVRows(engine, 8192).page(1)
    data = page.rows.tobytes()
    for source in (page, memoryview(data)):
        [raw] = page_chunks(b"k" * 16, b"n" * 16, layout, source, None, durable=True, flags=2)
        msg = data_pb2.PageChunk.FromString(raw)
        assert (msg.checksum, msg.data, msg.page_bytes, msg.durable, msg.flags) == (checksum(data), data, len(data), True, 2)
        chunk = decode_chunk(raw)
        assert chunk.error is None and chunk.checksum == checksum(data) and bytes(chunk.data) == data
        chunks = [decode_chunk(r) for r in page_chunks(b"k" * 16, b"n" * 16, layout, source, None, chunk_bytes=4096)]
        assert len(chunks) == 4 and {c.checksum for c in chunks} == {checksum(data)}
        assert b"".join(bytes(c.data) for c in chunks) == data


def test_an_unverified_page_lands_unhashed_but_its_chunks_must_agree() -> None:
    """``ChunkedPage(verify=False)`` (a node's unhashed landing, DESIGN §4): damaged bytes land (their
    consumer checks them), but chunks out of order, past the length, or naming another length or
    checksum than the first are refused, as the page is committed with what they say."""
    from kvstore._proto import common_pb2
    from kvstore.page_wire.grpc_chunks import BufferSink, ChunkedPage, decode_chunk, page_chunks

    data = bytes(range(256)) * 64
    layout = common_pb2.Layout(num_layers=1, kv_factor=2, num_kv_heads=1, head_dim=64, dtype="float16", page_tokens=64)

    def chunks(payload: bytes, sum_: int, chunk_bytes: int = 4096) -> list:
        return [decode_chunk(raw) for raw in page_chunks(b"k" * 16, b"n" * 16, layout, memoryview(payload), sum_,
                                                         chunk_bytes=chunk_bytes)]

    def page(dest: bytearray, verify: bool = False) -> ChunkedPage:
        return ChunkedPage(b"k" * 16, len(data), checksum(data), BufferSink(memoryview(dest)), "page", InvalidRequest, verify)

    damaged = data[:5000] + b"\0" + data[5001:]
    for chunk_bytes in (4096, len(data)):  # four chunks, one
        dest = bytearray(len(data))
        unverified = page(dest)
        assert [unverified.add(c) for c in chunks(damaged, checksum(data), chunk_bytes)][-1]
        assert bytes(dest) == damaged
        verified = page(bytearray(len(data)), verify=True)
        with pytest.raises(PageCorrupt, match="checksum"):
            for c in chunks(damaged, checksum(data), chunk_bytes):
                verified.add(c)
    whole, other = chunks(data, checksum(data)), chunks(data, checksum(data) ^ 1)
    for bad in ([whole[0], other[1]], [whole[1]], [whole[0], whole[0]]):
        unverified = page(bytearray(len(data)))
        with pytest.raises(InvalidRequest):
            for c in bad:
                unverified.add(c)
