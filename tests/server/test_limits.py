"""A rejected request leaves no trace (no pin, no slot, no namespace binding), and what a
caller can make the server hold is bounded: hint etas, remote records."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from support.kv import random_kv
from support.servers import make_config

from kvstore._proto import common_pb2, data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.page import checksum
from kvstore.server.placement import Placement

NS = b"n" * 16
KEY = b"k" * 16
LAYOUT = common_pb2.Layout(num_layers=4, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _rejected(call: Callable[..., Any], request: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = call(request, timeout=10)
        if hasattr(result, "__iter__"):
            list(result)
    return err.value.code(), err.value.details()


async def test_rejected_acquires_and_reads_pin_nothing(server_factory, layout, ns) -> None:
    """Bug: Acquire and ReadPages pinned the pages before checking
    ``ttl_ms``; every call rejected with INVALID_ARGUMENT left its pages pinned for good, so
    the host tier filled with pins and each write failed with RESOURCE_EXHAUSTED."""
    server = server_factory(host_bytes=4 << 20, ssd_bytes=None)  # 128 pages of 32 KiB
    tokens = list(range(16 * 128))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens))) == len(tokens)
        keys = (await client.lookup(tokens)).keys
    with grpc.insecure_channel(server.address) as channel:
        data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
        for i in range(1000):
            if i % 2:
                code, details = _rejected(data.Acquire, data_pb2.AcquireRequest(
                    namespace_id=ns.namespace_id, keys=keys, ttl_ms=10**9))
            else:
                code, details = _rejected(data.ReadPages, data_pb2.ReadPagesRequest(
                    namespace_id=ns.namespace_id, keys=keys, ttl_ms=10**9))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "ttl" in details
        assert directory.Stats(directory_pb2.StatsRequest(), timeout=10).num_leases == 0
    fresh = list(range(10**6, 10**6 + 16 * 128))
    async with KVStoreClient(server.address, ns) as client:
        assert await client.put(fresh, random_kv(layout, len(fresh), seed=1)) == len(fresh), "no page may stay pinned"


def test_rejected_allocates_bind_no_layout(server_factory) -> None:
    """Bug: Allocate bound the request's layout to the namespace before
    checking it, so after one rejected oversized layout the namespace's real owner got
    FAILED_PRECONDITION until restart. An allocate refused for want of room binds nothing
    either."""
    server = server_factory(host_bytes=4 << 20, ssd_bytes=None)  # 4 MiB slabs, 128 pages of LAYOUT
    oversized = common_pb2.Layout(num_layers=4096, kv_factor=2, num_kv_heads=64, head_dim=256, dtype="float32", page_tokens=64)
    over_slab = common_pb2.Layout(num_layers=64, kv_factor=2, num_kv_heads=8, head_dim=128, dtype="float16", page_tokens=32)
    with grpc.insecure_channel(server.address) as channel:
        data = data_pb2_grpc.DataStub(channel)
        for i in range(1000):
            bad = (oversized, over_slab)[i % 2]
            code, details = _rejected(data.Allocate, data_pb2.AllocateRequest(namespace_id=NS, layout=bad, keys=[KEY]))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and ("exceeds" in details or "slab" in details), details
        owner = data.Allocate(data_pb2.AllocateRequest(namespace_id=NS, layout=LAYOUT, keys=[KEY]), timeout=10)
        data.Abort(data_pb2.AbortRequest(allocation_id=owner.allocation_id), timeout=10)

        # The tier is full of reservations: an allocate for another namespace finds no room.
        full = data.Allocate(data_pb2.AllocateRequest(namespace_id=NS, layout=LAYOUT, keys=[_key(i) for i in range(128)]),
                             timeout=10)
        assert len(full.slots) == 128
        other_ns = b"o" * 16
        code, _ = _rejected(data.Allocate, data_pb2.AllocateRequest(namespace_id=other_ns, layout=over_slab, keys=[KEY]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        small = common_pb2.Layout(num_layers=2, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)
        code, _ = _rejected(data.Allocate, data_pb2.AllocateRequest(namespace_id=other_ns, layout=small, keys=[KEY]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        data.Abort(data_pb2.AbortRequest(allocation_id=full.allocation_id), timeout=10)
        owner = data.Allocate(data_pb2.AllocateRequest(namespace_id=other_ns, layout=LAYOUT, keys=[KEY]), timeout=10)
        assert len(owner.slots) == 1, "the refused allocate must not have bound its layout"


def test_hint_eta_is_capped_and_a_rejected_hint_changes_nothing(server) -> None:
    """Bug: Hint accepted any eta a uint32 holds (49 days), so hints
    piled up for weeks. An eta beyond --max-hint-eta-s is INVALID_ARGUMENT, and a request
    with one bad entry applies none of its entries."""
    with grpc.insecure_channel(server.address) as channel:
        data = data_pb2_grpc.DataStub(channel)
        entries = [data_pb2.HintEntry(keys=[_key(1)], eta_ms=1000), data_pb2.HintEntry(keys=[_key(2)], eta_ms=49 * 86_400_000)]
        code, details = _rejected(data.Hint, data_pb2.HintRequest(namespace_id=NS, entries=entries))
        limit_ms = int(server.config.max_hint_eta_s * 1000)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "eta" in details and str(limit_ms) in details, details
        assert not server.core.view().num_hinted, "no entry of a rejected hint may be applied"
        ok = data.Hint(data_pb2.HintRequest(namespace_id=NS, entries=[data_pb2.HintEntry(keys=[_key(1)], eta_ms=limit_ms)]),
                       timeout=10)
        assert list(ok.reserved) == [True]


def test_the_hints_a_caller_can_make_the_server_hold_are_bounded(server_factory) -> None:
    """Bug: item 12 capped a hint's eta at --max-hint-eta-s, but not how many announced uses
    the server keeps: every key of every Hint entry (4,096 per entry, 4,096 entries per
    request) is held for up to an hour plus grace, whether or not the page exists. One
    caller sending 64 x 4,096 distinct keys per request grows the server without bound
    (measured: 8 such requests, 124 -> 916 MB RSS). Beyond a bound proportional to the host
    tier, a Hint must be refused (RESOURCE_EXHAUSTED) or displace older hints."""
    server = server_factory(host_bytes=4 << 20, ssd_bytes=None)  # 128 pages
    host_pages = server.core.view().tiers["host"].capacity_bytes // (32 << 10)
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        data = data_pb2_grpc.DataStub(channel)
        for r in range(2):
            entries = [data_pb2.HintEntry(keys=[_key(r << 24 | e << 12 | i) for i in range(4096)], eta_ms=3_600_000)
                       for e in range(64)]
            try:
                data.Hint(data_pb2.HintRequest(namespace_id=NS, entries=entries), timeout=60)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
    held = server.core.view().num_hinted
    assert held <= 64 * host_pages, f"{held} hinted keys held for a host tier of {host_pages} pages"


def _lines_run(call: Callable[[], object]) -> int:
    """Python lines executed by ``call`` (in every module): a count of work done that a
    loaded machine does not change, unlike a time."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def test_hint_expiry_work_grows_with_expired_hints_not_with_all_hints(tmp_path) -> None:
    """Bug: every Stats, Allocate, Acquire and Hint reaped expired hints
    by scanning all of them under the global lock (260k hints: Stats 2 -> 98 ms). Reaping
    must cost what expired, not what is stored."""
    now = [1000.0]
    core = Placement(make_config(tmp_path), clock=lambda: now[0])
    try:
        keys = [_key(i) for i in range(60_000)]
        core.hint(NS, keys[:59_000], eta_s=600, prefetch=False)
        core.hint(NS, keys[59_000:], eta_s=1, prefetch=False)
        core.stats()
        idle = _lines_run(core.stats)
        now[0] += 1 + core.config.host.hint_grace_s + 1  # the 1,000 hints due at +1 s are past their grace
        expiring = _lines_run(core.stats)
        after = _lines_run(core.stats)
        assert core.view().num_hinted == 59_000
    finally:
        core.close()
    assert idle < 3_000, f"{idle} lines with 60,000 hints and none expired"
    assert after < 3_000
    assert expiring < idle + 30 * 1_000, f"{expiring} lines to expire 1,000 of 60,000 hints"


def _records(node: str, keys: list[bytes]) -> list[directory_pb2.PageRecord]:
    return [directory_pb2.PageRecord(key=k, location=common_pb2.Location(node=node, tier="remote", size_bytes=4096)) for k in keys]


def _publish(directory: Any, node: str, keys: list[bytes]) -> Any:
    return directory.Publish(directory_pb2.PublishRequest(namespace_id=NS, records=_records(node, keys)), timeout=30)


def _lookup(directory: Any, keys: list[bytes]) -> int:
    return directory.Lookup(directory_pb2.LookupRequest(namespace_id=NS, keys=keys), timeout=10).num_pages


def test_remote_records_are_bounded_per_node_and_in_total(server_factory, tmp_path) -> None:
    """Bug: Publish took any number of records of other nodes (10 x
    65,536 took the server from 130 MB to 1 GB RSS). Beyond --max-remote-records-per-node
    (per node named in the records: the caller, until callers are authenticated) or
    --max-remote-records in total a Publish is RESOURCE_EXHAUSTED and nothing of it is
    applied; removals give room back, and the counts survive a restart."""
    config = make_config(tmp_path, max_remote_records_per_node=1000, max_remote_records=2500)
    server = server_factory(config)
    a_keys, b_keys, c_keys = ([_key(base + i) for i in range(1000)] for base in (0, 10_000, 20_000))
    with grpc.insecure_channel(server.address) as channel:
        directory = directory_pb2_grpc.DirectoryStub(channel)
        assert len(_publish(directory, "a", a_keys).versions) == 1000
        with pytest.raises(grpc.RpcError) as err:
            _publish(directory, "a", [_key(5000)])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "node a" in err.value.details()
        assert len(_publish(directory, "a", a_keys[:10]).versions) == 10, "publishing a known location again adds nothing"
        with pytest.raises(grpc.RpcError) as err:  # a batch over the bound: none of it is applied
            records = [*_records("b", b_keys[:10]), *_records("a", [_key(5000)])]
            directory.Publish(directory_pb2.PublishRequest(namespace_id=NS, records=records), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _lookup(directory, b_keys[:1]) == 0
        _publish(directory, "b", b_keys)
        with pytest.raises(grpc.RpcError) as err:
            _publish(directory, "c", c_keys[:600])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2500" in err.value.details()
        assert _lookup(directory, c_keys[:1]) == 0
        _publish(directory, "c", c_keys[:500])
        directory.Remove(directory_pb2.RemoveRequest(namespace_id=NS, keys=a_keys[:100]), timeout=10)
        _publish(directory, "a", [_key(5000 + i) for i in range(100)])
    server.stop()
    server = server_factory(config)
    with grpc.insecure_channel(server.address) as channel:
        directory = directory_pb2_grpc.DirectoryStub(channel)
        assert _lookup(directory, a_keys[100:]) == 900
        with pytest.raises(grpc.RpcError) as err:
            _publish(directory, "a", [_key(9999)])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, "the counts are rebuilt at start"
        directory.Invalidate(directory_pb2.InvalidateRequest(namespace_id=NS), timeout=10)
        assert len(_publish(directory, "a", [_key(30_000 + i) for i in range(1000)]).versions) == 1000



def test_a_hint_whose_prefetch_finds_the_host_tier_leased_full_answers_not_reserved(server_factory) -> None:
    """Bug: a Hint whose prefetch found no landing slot (every page in the host tier leased)
    failed as a whole with RESOURCE_EXHAUSTED after its hints were announced (and, with
    quotas, its hint charge refunded while the announced uses stayed held). The prefetch's
    space is a reservation: without room the entry is answered not reserved (False) at once,
    and the engine recomputes."""
    server = server_factory(host_bytes=4 << 20)
    layout = common_pb2.Layout(num_layers=2, kv_factor=2, num_kv_heads=1, head_dim=8, dtype="float32", page_tokens=4)
    page_bytes = 2 * 2 * 1 * 8 * 4 * 4

    def chunk(key: bytes, durable: bool = False) -> data_pb2.PageChunk:
        payload = bytes([key[-1]]) * page_bytes
        return data_pb2.PageChunk(key=key, namespace_id=NS, layout=layout, page_bytes=page_bytes, checksum=checksum(payload),
                                  offset=0, data=payload, durable=durable)

    with grpc.insecure_channel(server.address) as channel:
        data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
        below = _key(1 << 20)
        assert data.WritePages(iter([chunk(below, durable=True)]), timeout=10).num_published == 1
        directory.Remove(directory_pb2.RemoveRequest(namespace_id=NS, keys=[below], tier="host"), timeout=10)
        leased, i = 0, 0
        while True:  # fills the host tier with leased pages
            keys = [_key(i + j) for j in range(64)]
            i += 64
            full = False
            try:
                data.WritePages(iter([chunk(k) for k in keys]), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                full = True  # the pages stored before the refusal are leased too
            leased += len(data.Acquire(data_pb2.AcquireRequest(namespace_id=NS, keys=keys, ttl_ms=60_000), timeout=10).pages)
            if full:
                break
        assert leased and server.core.where(below) == {"ssd": server.core.where(below)["ssd"]}
        answer = data.Hint(data_pb2.HintRequest(namespace_id=NS, entries=[data_pb2.HintEntry(keys=[below], eta_ms=1000)]),
                           timeout=10)
        assert list(answer.reserved) == [False]
