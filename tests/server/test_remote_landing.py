"""A node fetching pages over gRPC ReadPages (the remote tier's fallback plane) copies each
page into its landing slot and verifies it as it arrives: a page whose bytes were damaged in
flight must never be committed, nor any page after it (DESIGN §11: the receive path is where
remote-get speedups are tried; the UCX plane has its own test in tests/cluster)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import grpc
from support.servers import make_config

from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.page import checksum
from kvstore.page_wire.grpc_chunks import MESSAGE_OPTIONS, PageStubs
from kvstore.server.cluster.remote import RemoteTier

LAYOUT = common_pb2.Layout(num_layers=2, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)
PAGE_BYTES = 2 * 2 * 2 * 64 * 2 * 16


class DamagingLink:
    """The holder's real ReadPages stream, with one byte of the ``bad``-th message flipped on
    its way (what a faulty NIC or proxy would do): the peer as ``RemoteTier`` calls it."""

    def __init__(self, channel: grpc.aio.Channel, bad: int) -> None:
        self.member = type("Member", (), {"node_id": "holder"})()
        self.pages = self
        self._stubs = PageStubs(channel)
        self._bad = bad

    def read_pages(self, request: data_pb2.ReadPagesRequest, timeout: float) -> Any:
        call = self._stubs.read_pages(request, timeout=timeout)
        bad = self._bad

        class Damaged:
            def __aiter__(self) -> AsyncIterator[bytes]:
                return self.messages()

            async def messages(self) -> AsyncIterator[bytes]:
                n = 0
                async for raw in call:
                    if n == bad:
                        raw = bytearray(raw)
                        raw[len(raw) // 2] ^= 0xFF  # inside the page's bytes
                        raw = bytes(raw)
                    n += 1
                    yield raw

            def cancel(self) -> None:
                call.cancel()

        return Damaged()


def _store(address: str, ns: bytes, keys: list[bytes], pages: list[bytes]) -> None:
    with grpc.insecure_channel(address) as channel:
        stored = data_pb2_grpc.DataStub(channel).WritePages(iter([
            data_pb2.PageChunk(key=k, namespace_id=ns, layout=LAYOUT, page_bytes=PAGE_BYTES, checksum=checksum(p), data=p)
            for k, p in zip(keys, pages)]))
        assert stored.num_published == len(keys)


def _found(address: str, ns: bytes, keys: list[bytes]) -> int:
    with grpc.insecure_channel(address) as channel:
        found = directory_pb2_grpc.DirectoryStub(channel).Lookup(directory_pb2.LookupRequest(namespace_id=ns, keys=keys))
        return found.num_pages


async def test_a_page_damaged_in_flight_is_not_committed(server_factory, tmp_path) -> None:
    """Page 2 of 4, damaged on the wire, fails its check and ends the fetch; page 1 is
    committed bit-exact, pages 2-4 are not findable on the receiver."""
    holder, receiver = server_factory(), server_factory(make_config(tmp_path / "receiver"))
    ns = secrets.token_bytes(16)
    keys = [secrets.token_bytes(16) for _ in range(4)]
    pages = [secrets.token_bytes(PAGE_BYTES) for _ in keys]
    _store(holder.address, ns, keys, pages)
    tier = RemoteTier(receiver.core, None, None, "grpc")  # type: ignore[arg-type]  # no cluster: the peer is given
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        got = await tier._fetch_grpc(DamagingLink(channel, bad=1), ns, keys, 10.0)  # type: ignore[arg-type]
    assert got == 1
    assert _found(receiver.address, ns, keys) == 1
    with grpc.insecure_channel(receiver.address) as channel:
        chunks = list(data_pb2_grpc.DataStub(channel).ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys)))
    assert b"".join(c.data for c in chunks) == pages[0]


async def test_an_undamaged_fetch_lands_every_page(server_factory, tmp_path) -> None:
    """The same path with nothing damaged: every page committed, bit-exact."""
    holder, receiver = server_factory(), server_factory(make_config(tmp_path / "receiver"))
    ns = secrets.token_bytes(16)
    keys = [secrets.token_bytes(16) for _ in range(6)]
    pages = [secrets.token_bytes(PAGE_BYTES) for _ in keys]
    _store(holder.address, ns, keys, pages)
    tier = RemoteTier(receiver.core, None, None, "grpc")  # type: ignore[arg-type]
    async with grpc.aio.insecure_channel(holder.address, options=MESSAGE_OPTIONS) as channel:
        got = await tier._fetch_grpc(DamagingLink(channel, bad=-1), ns, keys, 10.0)  # type: ignore[arg-type]
    assert got == len(keys)
    with grpc.insecure_channel(receiver.address) as channel:
        chunks = list(data_pb2_grpc.DataStub(channel).ReadPages(data_pb2.ReadPagesRequest(namespace_id=ns, keys=keys)))
    assert b"".join(c.data for c in chunks) == b"".join(pages)
