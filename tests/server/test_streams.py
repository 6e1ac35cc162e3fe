"""Open streams never take the capacity unary calls need: streams are bounded on their own
(RESOURCE_EXHAUSTED beyond --max-streams), idle ones are closed, and a peer that stopped
answering keepalive pings loses its streams."""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
from support.kv import SMALL, random_kv

from kvstore import Namespace
from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import KILL_WAIT_S
from kvstore.client import KVStoreClient
from kvstore.page import checksum

NAMESPACE = Namespace(model="streams", revision="r1", layout=SMALL)
NS = NAMESPACE.namespace_id
LAYOUT = common_pb2.Layout(num_layers=4, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)
PAGE = bytes(range(256)) * 128  # one page of LAYOUT (32 KiB)


def _half_page_then_wait(release: threading.Event) -> Iterator[data_pb2.PageChunk]:
    """A WritePages stream that sends the first half of a page, then nothing."""
    yield data_pb2.PageChunk(key=b"w" * 16, offset=0, data=PAGE[:16384], page_bytes=len(PAGE), checksum=checksum(PAGE),
                             namespace_id=NS, layout=LAYOUT)
    release.wait()


def _silent(release: threading.Event) -> Iterator[data_pb2.PageChunk]:
    release.wait()
    yield from ()


class _Streams:
    """Idle streams of every kind, opened on one channel; ``ended`` gets (kind, code) as each ends."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.data = data_pb2_grpc.DataStub(self.channel)
        self.directory = directory_pb2_grpc.DirectoryStub(self.channel)
        self.release = threading.Event()
        self.calls: list[Any] = []
        self.ended: queue.Queue[tuple[str, grpc.StatusCode]] = queue.Queue()

    def _track(self, kind: str, call: Any) -> None:
        self.calls.append(call)
        call.add_done_callback(lambda c: self.ended.put((kind, c.code())))

    def subscribe(self) -> None:
        self._track("Subscribe", self.directory.Subscribe(directory_pb2.SubscribeRequest()))

    def read_unread(self, keys: list[bytes]) -> None:
        """A ReadPages call that is never read: the server blocks sending once the
        flow-control window is full."""
        self._track("ReadPages", self.data.ReadPages(data_pb2.ReadPagesRequest(namespace_id=NS, keys=keys)))

    def write(self, half_page: bool = False) -> None:
        chunks = _half_page_then_wait(self.release) if half_page else _silent(self.release)
        self._track("WritePages", self.data.WritePages.future(chunks))

    def drain(self, call: Any) -> tuple[int, grpc.StatusCode]:
        """Reads what a call delivered (a client learns a response stream's status only
        after reading the messages before it); returns the count and the status."""
        count = 0
        try:
            for _ in call:
                count += 1
        except grpc.RpcError as exc:
            return count, exc.code()
        return count, grpc.StatusCode.OK

    def wait_ended(self, count: int, timeout_s: float) -> list[tuple[str, grpc.StatusCode]]:
        out = []
        deadline = time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            try:
                out.append(self.ended.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return out

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        self.channel.close()


async def _store_pages(address: str, count: int) -> list[bytes]:
    tokens = list(range(16 * count))
    async with KVStoreClient(address, NAMESPACE) as client:
        assert await client.put(tokens, random_kv(SMALL, len(tokens))) == len(tokens)
        return (await client.lookup(tokens)).keys


async def test_idle_streams_do_not_starve_unary_calls(server_factory) -> None:
    """Bug: every stream held a worker thread for as long as it was
    open, so 8 Subscribe plus 8 idle WritePages streams took all 16 workers and Stats and
    a fresh client's Lookup timed out. With 32 idle streams open (Subscribe, WritePages,
    unread ReadPages) a fresh client's Lookup and Stats answer (within 2 s: starved, they wait
    for a stream to end, which idle streams do only after --stream-idle-s; 100 ms failed under a
    loaded CI), and streams beyond --max-streams are refused at once."""
    server = server_factory()
    keys = await _store_pages(server.address, 512)  # 16 MiB: more than a stream's flow-control window
    streams = _Streams(server.address)
    try:
        for _ in range(8):
            streams.subscribe()
        for i in range(24):
            streams.read_unread(keys) if i % 2 else streams.write()
        for _ in range(4):
            streams.write()
        refused = streams.wait_ended(4, timeout_s=10)  # the 4 beyond the default limit of 32 end at once
        with grpc.insecure_channel(server.address) as fresh:
            grpc.channel_ready_future(fresh).result(timeout=10)
            directory = directory_pb2_grpc.DirectoryStub(fresh)
            for _ in range(5):
                assert directory.Lookup(directory_pb2.LookupRequest(namespace_id=NS, keys=keys[:8]), timeout=2).num_pages == 8
                assert directory.Stats(directory_pb2.StatsRequest(), timeout=2).num_entries >= 512
        assert server.config.max_streams == 32 and len(refused) == 4, refused
        assert {code for _, code in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
        assert streams.ended.empty(), "the 32 streams within the limit stay open while they are not idle too long"
    finally:
        streams.close()


async def test_idle_streams_are_closed_and_leave_nothing_behind(server_factory) -> None:
    """A stream that moves no message for --stream-idle-s is cancelled: its thread, its
    stream slot, its lease (ReadPages) and its half-written page's slot (WritePages) are
    given back."""
    server = server_factory(stream_idle_s=3.0, max_streams=3, max_subscribers=1)  # idle well after the 4th stream is refused
    keys = await _store_pages(server.address, 512)
    streams = _Streams(server.address)
    try:
        used = server.core.view().tiers["host"].used_bytes
        streams.subscribe()
        streams.read_unread(keys)
        streams.write(half_page=True)
        assert streams.wait_ended(1, timeout_s=0.5) == [], "nothing ends before it is idle"
        streams.write()
        assert streams.wait_ended(1, timeout_s=10) == [("WritePages", grpc.StatusCode.RESOURCE_EXHAUSTED)]
        ended = streams.wait_ended(2, timeout_s=10)
        assert sorted(ended) == [("Subscribe", grpc.StatusCode.CANCELLED), ("WritePages", grpc.StatusCode.CANCELLED)]
        deadline = time.monotonic() + 10
        while streams.directory.Stats(directory_pb2.StatsRequest(), timeout=10).num_leases:
            assert time.monotonic() < deadline, "the unread ReadPages stream kept its lease"
            await asyncio.sleep(0.05)
        pages, code = streams.drain(streams.calls[1])
        assert code == grpc.StatusCode.CANCELLED and pages < 512, "the server gave up on the unread stream"
        assert server.core.view().tiers["host"].used_bytes == used, "the half-written page's slot is freed"
        whole = [data_pb2.PageChunk(key=b"x" * 16, offset=0, data=PAGE, page_bytes=len(PAGE), checksum=checksum(PAGE),
                                    namespace_id=NS, layout=LAYOUT)]
        assert streams.data.WritePages(iter(whole), timeout=10).num_published == 1, "the slots are free again"
    finally:
        streams.close()


_FROZEN_PEER = textwrap.dedent("""
    import sys, grpc
    from kvstore._proto import directory_pb2, directory_pb2_grpc
    channel = grpc.insecure_channel(sys.argv[1])
    call = directory_pb2_grpc.DirectoryStub(channel).Subscribe(directory_pb2.SubscribeRequest())
    print("subscribed", flush=True)
    for _ in call:
        pass
""")


def _subscribe_outcome(address: str) -> grpc.StatusCode:
    """RESOURCE_EXHAUSTED when no stream slot is free; DEADLINE_EXCEEDED when the
    subscription was admitted (it stays open, waiting for events)."""
    with grpc.insecure_channel(address) as channel:
        call = directory_pb2_grpc.DirectoryStub(channel).Subscribe(directory_pb2.SubscribeRequest(), timeout=0.5)
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_a_frozen_peer_loses_its_streams_to_keepalive(server_factory) -> None:
    """A client that stops answering (SIGSTOP: its TCP stays up, its gRPC does not answer
    pings) has its connection closed after --keepalive-s + --keepalive-timeout-s, which
    frees its stream slot, long before --stream-idle-s."""
    server = server_factory(max_streams=1, max_subscribers=1, stream_idle_s=120.0, keepalive_s=1.0, keepalive_timeout_s=1.0)
    peer = subprocess.Popen([sys.executable, "-c", _FROZEN_PEER, server.address], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "subscribed"
        deadline = time.monotonic() + 10
        while _subscribe_outcome(server.address) != grpc.StatusCode.RESOURCE_EXHAUSTED:  # until the peer holds the slot
            assert time.monotonic() < deadline, "the peer's subscription was never admitted"
        peer.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        while _subscribe_outcome(server.address) != grpc.StatusCode.DEADLINE_EXCEEDED:
            assert time.monotonic() - start < 15, "the frozen peer kept its stream slot"
    finally:
        peer.kill()
        peer.wait(KILL_WAIT_S)


def test_a_stream_the_client_cancels_is_no_server_fault(server) -> None:
    """A WritePages the client cancels mid-page gives its slot back, and is counted as
    CANCELLED, not as INTERNAL with a traceback logged as an unexpected error (the metric
    operators alert on as a server bug)."""
    streams = _Streams(server.address)
    try:
        streams.write(half_page=True)
        deadline = time.monotonic() + 10
        while server.core.view().tiers["host"].used_bytes == 0:  # until the server reserved the page's slot
            assert time.monotonic() < deadline
            time.sleep(0.01)
        streams.calls[0].cancel()
        assert streams.wait_ended(1, timeout_s=10) == [("WritePages", grpc.StatusCode.CANCELLED)]
        while server.core.view().tiers["host"].used_bytes:
            assert time.monotonic() < deadline, "the cancelled stream's slot was not freed"
            time.sleep(0.01)
    finally:
        streams.close()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'kvstore_rpc_errors_total{code="CANCELLED",method="WritePages"} 1.0' in metrics
    assert 'code="INTERNAL"' not in metrics
