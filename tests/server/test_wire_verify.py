"""The server checks a landing page's bytes before it sends them over the wire (DESIGN §11,
item 4): whoever maps an arena can write into any slot of it, so a damaged page must be
quarantined, never streamed out under its checksum nor left stored."""

from __future__ import annotations

import secrets

import grpc
import pytest
from support.servers import flip_arena_byte

from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.page import checksum
from kvstore.page_wire.grpc_chunks import MESSAGE_OPTIONS, PageStubs, decode_chunk

LAYOUT = common_pb2.Layout(num_layers=2, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)
PAGE_BYTES = 2 * 2 * 2 * 64 * 2 * 16


def _write(data: data_pb2_grpc.DataStub, ns: bytes, keys: list[bytes], pages: list[bytes],
           layout: common_pb2.Layout = LAYOUT) -> int:
    """One WritePages of ``pages``, a chunk each: how many the server published."""
    return data.WritePages(iter([data_pb2.PageChunk(key=k, namespace_id=ns, layout=layout, page_bytes=len(p),
                                                    checksum=checksum(p), data=p) for k, p in zip(keys, pages)])).num_published


def _three_pages(data: data_pb2_grpc.DataStub) -> tuple[bytes, list[bytes], list[bytes]]:
    """Three random pages written in a namespace of their own: (namespace, keys, pages)."""
    ns, keys = secrets.token_bytes(16), [secrets.token_bytes(16) for _ in range(3)]
    pages = [secrets.token_bytes(PAGE_BYTES) for _ in keys]
    assert _write(data, ns, keys, pages) == 3
    return ns, keys, pages


@pytest.mark.parametrize("chunk_bytes", [4 << 20, 4096], ids=["page-per-message", "chunks"])
def test_a_damaged_landing_page_is_quarantined_not_streamed(server, chunk_bytes: int) -> None:
    """Bug: ReadPages streamed a landing page straight from its slot without checking it,
    so bytes scribbled into the arena went out over the wire (the receiver alone noticed)
    and the damaged page stayed stored and findable."""
    with grpc.insecure_channel(server.address) as channel:
        data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
        ns, keys, pages = _three_pages(data)
        flip_arena_byte(server, server.core.where(keys[1])["host"] + 100)  # a client that maps the arena scribbles
        chunks = list(data.ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys, chunk_bytes=chunk_bytes)))
        sent = b"".join(c.data for c in chunks)
        assert {c.key for c in chunks} == {keys[0]}, "the stream ends before the damaged page"
        assert sent == pages[0]
        assert keys[1] in [q.key for q in server.core.quarantined()]
        assert directory.Lookup(directory_pb2.LookupRequest(namespace_id=ns, keys=keys)).num_pages == 1


def test_a_reader_that_checks_pages_itself_gets_them_unchecked_and_has_a_failed_one_checked(server) -> None:
    """A reader that checks every page itself (the client library, DESIGN §4) asks ``unchecked``:
    the server sends the stored bytes without hashing them first (before, it did so only for a
    node's fetch, and hashed every page a client read: a second pass over the same bytes). The
    reader's own check finds the damage; its read of that page alone, checked, has the server
    find it too and quarantine it, so it is never promised again."""
    with grpc.insecure_channel(server.address) as channel:
        data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
        ns, keys, pages = _three_pages(data)
        flip_arena_byte(server, server.core.where(keys[1])["host"] + 100)
        chunks = list(data.ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys, unchecked=True)))
        assert [c.key for c in chunks] == keys, "sent unchecked: every page, the damaged one too"
        damaged = chunks[1]
        assert damaged.checksum == checksum(pages[1]) != checksum(damaged.data), "under its stored checksum, which it fails"
        assert keys[1] not in [q.key for q in server.core.quarantined()], "the server did not look at it"
        again = list(data.ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=[keys[1]])))
        assert again == [], "read again checked: not sent"
        assert keys[1] in [q.key for q in server.core.quarantined()]
        assert directory.Lookup(directory_pb2.LookupRequest(namespace_id=ns, keys=keys)).num_pages == 1


def test_an_unchecked_stream_never_sends_a_slot_reused_under_its_lease(server_factory) -> None:
    """A page quarantined while a reader's stream leases it. Bug pinned (review of unchecked client
    reads): the quarantine freed its slot at once, the next page written (another namespace's)
    landed there, and the stream's unchecked send copied it out under the quarantined page's key
    and checksum. Now the slot waits for the lease's end (test_quarantine_under_lease), and an
    unchecked send sends a page only if, once copied, its slot still holds it."""
    big = common_pb2.Layout(num_layers=8, kv_factor=2, num_kv_heads=8, head_dim=128, dtype="float16", page_tokens=32)
    page_bytes = 8 * 2 * 8 * 128 * 2 * 32  # 1 MiB: flow control holds the send well before the damaged page
    server = server_factory(host_bytes=96 << 20)
    ns, other_ns, damaged = secrets.token_bytes(16), secrets.token_bytes(16), 12
    keys = [secrets.token_bytes(16) for _ in range(16)]
    pages = [secrets.token_bytes(page_bytes) for _ in keys]
    other_key, other = secrets.token_bytes(16), b"ANOTHER!" * (page_bytes // 8)

    with grpc.insecure_channel(server.address, options=MESSAGE_OPTIONS) as channel:
        data = data_pb2_grpc.DataStub(channel)
        assert _write(data, ns, keys, pages, big) == len(keys)
        stream = PageStubs(channel).read_pages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys, unchecked=True))
        got = [next(stream)]
        slot = server.core.where(keys[damaged])["host"]
        flip_arena_byte(server, slot + 100)
        assert list(data.ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=[keys[damaged]]))) == []
        assert _write(data, other_ns, [other_key], [other], big) == 1
        assert server.core.where(other_key)["host"] != slot, "the leased slot waits for its readers (as a removal's)"
        got += list(stream)
    sent: dict[bytes, bytes] = {}
    for chunk in map(decode_chunk, got):
        sent[bytes(chunk.key)] = sent.get(bytes(chunk.key), b"") + bytes(chunk.data)
    assert keys[damaged] not in sent, "the stream ends before the page whose slot was freed under it"
    assert all(sent[k] == p for k, p in zip(keys, pages) if k in sent)
