"""A tenant's SSD share on a real server: ssd_bytes holds at demotion as at durable writes (its
own coldest SSD pages make room, never another tenant's), its share of the drive's write
budget (ssd_write_percent) is its own, and both show in Stats and in /metrics."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from support.tenants import LAYOUT, OPS, PAGE_BYTES, A, B, Caller, new_keys, new_ns, tenant_config, tenant_grants

from kvstore._proto import common_pb2, data_pb2, directory_pb2
from kvstore.page import checksum
from kvstore.server import Server

pytest_plugins = ["support.tenants"]

FULL = grpc.StatusCode.RESOURCE_EXHAUSTED


def _server(tmp_path, ca, quotas: dict[str, Any], dwpd: float = 0.0) -> Server:
    config = tenant_config(tmp_path, ca)
    assert config.security.auth_file is not None and config.ssd is not None
    config = dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, dwpd=dwpd))
    config.security.auth_file.write_text(json.dumps({"tokens": tenant_grants(), "quotas": quotas}))
    server = Server(config)
    server.start()
    return server


@pytest.fixture
def share_server(tmp_path, ca) -> Iterator[Server]:
    server = _server(tmp_path, ca, {"a": {"host_bytes": 3 * PAGE_BYTES, "ssd_bytes": 2 * PAGE_BYTES}})
    yield server
    server.stop(grace_s=1)


def test_demotion_keeps_a_tenant_within_its_ssd_share(share_server, ca) -> None:
    """Bug: ssd_bytes was checked at new pages only, not at demotion: a tenant below its share
    that wrote a batch to RAM had the whole batch demoted past it (and once at its share it
    could not write at all, even to RAM). Now a page demoted past the share pushes out the
    tenant's own coldest SSD pages, never another tenant's."""
    a, b = Caller(share_server, ca, A), Caller(share_server, ca, B)
    core, quotas = share_server.core, share_server.tenancy.quotas
    ns, ns_b, keys, keys_b = new_ns(), new_ns(), new_keys(4), new_keys(3)
    assert b.put(ns_b, keys_b, durable=True) == 3
    for key in keys:
        assert a.put(ns, [key]) == 1  # the 4th pushes a's coldest (keys[0]) down to SSD
    assert quotas.usage("a")["ssd_bytes"] == PAGE_BYTES
    alloc = a(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(3)))  # a's 3 RAM pages go down
    assert quotas.usage("a")["ssd_bytes"] <= 2 * PAGE_BYTES
    assert [set(core.where(k)) for k in keys] == [set(), set(), {"ssd"}, {"ssd"}], "a's coldest SSD pages made room"
    assert all("ssd" in core.where(k) for k in keys_b), "b's SSD pages stay"
    a(a.data.Abort, data_pb2.AbortRequest(allocation_id=alloc.allocation_id))
    assert a.put(ns, new_keys(2)) == 2, "a tenant at its SSD share still writes"
    assert quotas.usage("a")["ssd_bytes"] <= 2 * PAGE_BYTES


def test_durable_writes_at_the_ssd_share_replace_the_tenants_coldest(share_server, ca) -> None:
    """A durable write at the share pushes out the tenant's own coldest SSD page; when every
    one of them is pinned it is refused (RESOURCE_EXHAUSTED) and stores nothing below."""
    a = Caller(share_server, ca, A)
    quotas = share_server.tenancy.quotas
    ns, keys = new_ns(), new_keys(3)
    for key in keys:  # three one-page prefixes: no page keeps another in the host tier (server/placement/chains.py)
        assert a.put(ns, [key], durable=True) == 1
    assert [("ssd" in share_server.core.where(k)) for k in keys] == [False, True, True]
    a(a.data.Acquire, data_pb2.AcquireRequest(namespace_id=ns, keys=keys[1:]))  # a's SSD pages, pinned
    with pytest.raises(grpc.RpcError) as err:
        a.put(ns, new_keys(1), durable=True)
    assert err.value.code() == FULL and "ssd" in err.value.details()
    assert quotas.usage("a")["ssd_bytes"] == 2 * PAGE_BYTES


@pytest.fixture
def budget_server(tmp_path, ca) -> Iterator[Server]:
    server = _server(tmp_path, ca, {"a": {"ssd_write_percent": 1}}, dwpd=1.0)
    yield server
    server.stop(grace_s=1)


def test_a_tenant_has_its_share_of_the_ssd_write_budget(budget_server, ca) -> None:
    """New: one tenant could spend the drive's whole write budget (--ssd-dwpd) and leave none
    for the others. With ssd_write_percent it writes at most that share of the budget's rate
    and burst; another tenant's writes go on."""
    a, b, ops = Caller(budget_server, ca, A), Caller(budget_server, ca, B), Caller(budget_server, ca, OPS)
    ns, ns_b = new_ns(), new_ns()
    burst = budget_server.core.lower[0].budget.burst_bytes / 100
    written = 0
    for _ in range(200):
        try:
            a.put(ns, new_keys(1), durable=True)
        except grpc.RpcError as exc:
            assert exc.code() == FULL and "write" in exc.details()
            break
        written += 1
    assert 0 < written < 200
    assert b.put(ns_b, new_keys(written + 5), durable=True) == written + 5
    used = {t.tenant: t for t in ops(ops.directory.Stats, directory_pb2.StatsRequest()).tenants}
    assert 0 < used["a"].used["ssd_written_bytes"] <= burst + 1
    assert used["a"].limits["ssd_write_percent"] == 1 and used["b"].used["ssd_written_bytes"] > used["a"].used["ssd_written_bytes"]
    refused = budget_server.metrics.registry.get_sample_value("kvstore_tenant_quota_refusals_total",
                                                              {"tenant": "a", "quota": "ssd_write_percent"})
    assert refused == 1


def test_quota_refusals_are_counted_per_tenant(share_server, ca) -> None:
    a = Caller(share_server, ca, A)
    ns = new_ns()
    assert a.put(ns, new_keys(4)) == 4  # the 4th makes room by evicting a's coldest: not a refusal
    sample = share_server.metrics.registry.get_sample_value
    assert sample("kvstore_tenant_quota_refusals_total", {"tenant": "a", "quota": "host_bytes"}) is None
    with pytest.raises(grpc.RpcError):
        a(a.data.Allocate, data_pb2.AllocateRequest(namespace_id=ns, layout=LAYOUT, keys=new_keys(4)))  # more than its quota
    assert sample("kvstore_tenant_quota_refusals_total", {"tenant": "a", "quota": "host_bytes"}) == 1
    assert sample("kvstore_tenant_quota_refusals_total", {"tenant": "b", "quota": "host_bytes"}) is None


BIG = common_pb2.Layout(num_layers=2, kv_factor=2, num_kv_heads=1, head_dim=128, dtype="float32", page_tokens=32)
BIG_BYTES = 2 * 2 * 1 * 128 * 4 * 32  # 64 KiB


def _put_big(caller: Caller, ns: bytes, num_pages: int, durable: bool = False) -> list[bytes]:
    keys = new_keys(num_pages)
    chunks = []
    for key in keys:
        data = secrets.token_bytes(BIG_BYTES)
        chunks.append(data_pb2.PageChunk(key=key, namespace_id=ns, layout=BIG, page_bytes=BIG_BYTES, checksum=checksum(data),
                                         data=data, durable=durable))
    assert caller.data.WritePages(iter(chunks), metadata=caller.metadata, timeout=30).num_published == num_pages
    return keys


def test_the_demoter_keeps_a_tenant_within_its_ssd_share(tmp_path, ca) -> None:
    """Bug: the background demoter wrote a tenant's pages to the ssd whatever its ssd_bytes:
    a tenant that only wrote to RAM filled the ssd past its share."""
    config = tenant_config(tmp_path, ca, host_bytes=4 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.5, demote_to=0.25))
    assert config.security.auth_file is not None
    config.security.auth_file.write_text(json.dumps({"tokens": tenant_grants(), "quotas": {"a": {"ssd_bytes": 4 * BIG_BYTES}}}))
    server = Server(config)
    server.start()
    try:
        a, b = Caller(server, ca, A), Caller(server, ca, B)
        keys_b = _put_big(b, new_ns(), 4, durable=True)
        _put_big(a, new_ns(), 40)  # past demote_above: the demoter writes the coldest down to demote_to
        arena = server.core.landing.part("a")  # a's own: the landing tier's usage sums every tenant's arena
        deadline = time.monotonic() + 60
        while arena.usage().used_bytes > 0.25 * arena.usage().capacity_bytes and time.monotonic() < deadline:
            time.sleep(0.05)  # the demoter runs on its own thread; nothing signals its end
        assert arena.usage().used_bytes <= 0.25 * arena.usage().capacity_bytes, "the demoter made room"
        assert 0 < server.tenancy.quotas.usage("a")["ssd_bytes"] <= 4 * BIG_BYTES
        assert all("ssd" in server.core.where(k) for k in keys_b), "b's ssd pages stay"
    finally:
        server.stop(grace_s=1)


def test_a_tenant_out_of_its_write_share_costs_no_other_tenant_its_demotions(tmp_path, ca) -> None:
    """Bug (batched demotion): the demoter's batch stopped at the first page whose tenant's
    write share was spent, and the pages after it, other tenants' in a shared arena, left
    RAM unwritten (dropped from the cache instead of demoted). One page at a time, before the
    batches, only the spent tenant's page was not written."""
    config = tenant_config(tmp_path, ca)
    assert config.security.auth_file is not None and config.ssd is not None
    config = dataclasses.replace(config, ssd=dataclasses.replace(config.ssd, dwpd=1.0),
                                 host=dataclasses.replace(config.host, demote_above=1e-9, demote_to=1e-9),
                                 security=dataclasses.replace(config.security, share_arena=True))
    config.security.auth_file.write_text(json.dumps({"tokens": tenant_grants(), "quotas": {"a": {"ssd_write_percent": 1}}}))
    server = Server(config)
    server.start()
    server.demoter.stop()  # the test runs the demotion rounds itself, once both tenants' pages are in one batch
    try:
        a, b = Caller(server, ca, A), Caller(server, ca, B)
        ns, ns_b = new_ns(), new_ns()
        for _ in range(200):  # a spends its share of the write budget
            try:
                a.put(ns, new_keys(1), durable=True)
            except grpc.RpcError as exc:
                assert exc.code() == FULL
                break
        keys_a, keys_b = new_keys(3), new_keys(5)
        assert a.put(ns, keys_a) == 3  # the coldest: first in the demoter's batch
        assert b.put(ns_b, keys_b) == 5
        while server.core.demote_one():
            pass
        assert [sorted(server.core.where(k)) for k in keys_b] == [["ssd"]] * 5, "b's pages were not demoted"
    finally:
        server.stop(grace_s=1)
