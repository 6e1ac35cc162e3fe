"""Malformed, oversized and out-of-order requests get a clear status; the server keeps serving."""

from __future__ import annotations

import grpc
import pytest
from conftest import random_kv

from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import InvalidRequest, TierFull

NS = b"n" * 16
KEY = b"k" * 16
LAYOUT = common_pb2.Layout(num_layers=4, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)


@pytest.fixture
def stubs(server):
    channel = grpc.insecure_channel(server.address)
    yield directory_pb2_grpc.DirectoryStub(channel), data_pb2_grpc.DataStub(channel), channel
    channel.close()


def _status(call, request):
    with pytest.raises(grpc.RpcError) as err:
        result = call(request, timeout=10)
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize(
    "request_, expect",
    [
        (directory_pb2.LookupRequest(namespace_id=b"short", keys=[KEY]), "namespace_id must be 16 bytes"),
        (directory_pb2.LookupRequest(namespace_id=NS, keys=[b"x" * 15]), "keys[0] must be 16 bytes"),
        (directory_pb2.LookupRequest(namespace_id=NS, keys=[]), "keys must not be empty"),
        (directory_pb2.LookupRequest(namespace_id=NS, keys=[KEY] * 70000), "too many keys: 70000"),
    ],
)
def test_lookup_validation(stubs, request_, expect) -> None:
    code, details = _status(stubs[0].Lookup, request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and expect in details


@pytest.mark.parametrize(
    "layout, expect",
    [
        (common_pb2.Layout(num_layers=4, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="complex", page_tokens=16), "dtype"),
        (common_pb2.Layout(num_layers=0, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16), "num_layers"),
        (common_pb2.Layout(num_layers=4, kv_factor=3, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16), "kv_factor"),
        (common_pb2.Layout(num_layers=4096, kv_factor=2, num_kv_heads=64, head_dim=256, dtype="float32", page_tokens=64), "exceeds"),
    ],
)
def test_allocate_validation(stubs, layout, expect) -> None:
    code, details = _status(stubs[1].Allocate, data_pb2.AllocateRequest(namespace_id=NS, layout=layout, keys=[KEY]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and expect in details


def test_layout_mismatch_within_a_namespace(stubs) -> None:
    stubs[1].Allocate(data_pb2.AllocateRequest(namespace_id=NS, layout=LAYOUT, keys=[KEY]), timeout=10)
    other = common_pb2.Layout(num_layers=8, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)
    code, details = _status(stubs[1].Allocate, data_pb2.AllocateRequest(namespace_id=NS, layout=other, keys=[KEY]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "layout" in details


def test_unknown_allocation_and_bad_commit(stubs, server) -> None:
    code, details = _status(stubs[1].Commit, data_pb2.CommitRequest(allocation_id=999, keys=[KEY], checksums=[1]))
    assert code == grpc.StatusCode.ABORTED and "allocation 999" in details
    alloc = stubs[1].Allocate(data_pb2.AllocateRequest(namespace_id=NS, layout=LAYOUT, keys=[KEY]), timeout=10)
    code, details = _status(stubs[1].Commit, data_pb2.CommitRequest(allocation_id=alloc.allocation_id, keys=[KEY], checksums=[]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "checksums" in details
    # Regression: a rejected commit used to drop the allocation and leak its slots.
    stubs[1].Abort(data_pb2.AbortRequest(allocation_id=alloc.allocation_id), timeout=10)
    assert server.manager.host.usage().used_bytes == 0


def test_lease_ttl_and_publish_rules(stubs) -> None:
    code, details = _status(stubs[0].Lease, directory_pb2.LeaseRequest(namespace_id=NS, keys=[KEY], ttl_ms=10**9))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ttl" in details
    rec = directory_pb2.PageRecord(key=KEY, location=common_pb2.Location(node="local", tier="ssd"))
    code, details = _status(stubs[0].Publish, directory_pb2.PublishRequest(namespace_id=NS, records=[rec]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "published by its tiers" in details
    rec = directory_pb2.PageRecord(key=KEY, location=common_pb2.Location(node="other", tier="tape"))
    code, details = _status(stubs[0].Publish, directory_pb2.PublishRequest(namespace_id=NS, records=[rec]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tape" in details


def _chunks(data: bytes, checksum: int, offsets=None, page_bytes=None):
    page_bytes = page_bytes or len(data)
    for off in offsets or range(0, len(data), 1 << 14):
        first = off == 0
        yield data_pb2.PageChunk(key=KEY, offset=off, data=data[off : off + (1 << 14)], page_bytes=page_bytes, checksum=checksum,
                                 namespace_id=NS if first else b"", layout=LAYOUT if first else None)


def test_write_pages_checks(stubs, server) -> None:
    from kvstore.page import checksum

    data = bytes(range(256)) * 128  # 32 KiB: one page of LAYOUT
    code, details = _status(stubs[1].WritePages, _chunks(data, checksum(data) ^ 1))
    assert code == grpc.StatusCode.DATA_LOSS and "checksum" in details
    code, details = _status(stubs[1].WritePages, _chunks(data, checksum(data), offsets=[0, 16384 * 2]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "expected 16384" in details
    code, details = _status(stubs[1].WritePages, _chunks(data[:16384], checksum(data), offsets=[0], page_bytes=len(data)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ended after 16384" in details
    code, details = _status(stubs[1].WritePages, _chunks(data, checksum(data), page_bytes=1000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not match the layout" in details
    raw = stubs[2].stream_unary("/kvstore.v1.Data/WritePages")
    with pytest.raises(grpc.RpcError) as err:
        raw(iter([b"\xff" * 64]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed PageChunk" in err.value.details()
    assert server.manager.host.usage().used_bytes == 0, "a rejected stream must give back the slot it reserved"
    assert stubs[1].WritePages(_chunks(data, checksum(data)), timeout=10).num_published == 1
    r = stubs[0].Lookup(directory_pb2.LookupRequest(namespace_id=NS, keys=[KEY]), timeout=10)
    assert r.num_pages == 1


def test_read_pages_message_size_is_bounded(stubs) -> None:
    for size in (100, (8 << 20) + 1):
        code, details = _status(stubs[1].ReadPages, data_pb2.ReadPagesRequest(namespace_id=NS, keys=[KEY], chunk_bytes=size))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"chunk_bytes must be in [4096, {8 << 20}], got {size}" in details


async def test_client_side_errors_are_clear(server, layout, ns) -> None:
    with pytest.raises(InvalidRequest, match=r"chunk_bytes must be in \[4096, 8388608\], got 100"):
        KVStoreClient(server.address, ns, chunk_bytes=100)
    async with KVStoreClient(server.address, ns) as client:
        with pytest.raises(InvalidRequest, match="shape"):
            await client.put(list(range(32)), random_kv(layout, 32)[:, :1])
        with pytest.raises(InvalidRequest, match="dtype"):
            await client.put(list(range(32)), random_kv(layout, 32).float())
        with pytest.raises(InvalidRequest, match="holds 16 tokens, 32"):
            await client.put(list(range(32)), random_kv(layout, 16))


async def test_full_host_tier_is_resource_exhausted(server_factory, layout, ns) -> None:
    server = server_factory(host_bytes=4 << 20, ssd_bytes=None)  # 128 pages of 32 KiB
    tokens = list(range(16 * 128))
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, kv) == len(tokens)
        hit = await client.lookup(tokens)
        with grpc.insecure_channel(server.address) as ch:
            lease = directory_pb2_grpc.DirectoryStub(ch).Lease(
                directory_pb2.LeaseRequest(namespace_id=ns.namespace_id, keys=hit.keys, ttl_ms=60_000), timeout=10)
            assert lease.num_pages == 128
            with pytest.raises(TierFull, match="leased"):
                await client.put(list(range(10_000, 10_032)), kv)
            directory_pb2_grpc.DirectoryStub(ch).ReleaseLease(directory_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=10)
        assert await client.put(list(range(10_000, 10_032)), kv) == 32


def test_server_keeps_serving_after_garbage(stubs, server) -> None:
    raw = grpc.insecure_channel(server.address)
    call = raw.unary_unary("/kvstore.v1.Directory/Lookup", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        call(b"\xff\xff\xff\xff garbage", timeout=10)
    assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    raw.close()
    assert stubs[0].Stats(directory_pb2.StatsRequest(), timeout=10).node == "local"
