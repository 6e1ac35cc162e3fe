"""A tenant at its host quota makes room with its own pages (Placement.evict_own); those passes
lean on a put's chain as every other eviction does (DESIGN §6): other probation pages go first.

Bug pinned: evict_own searched with the pins alone (NotAmong over Leases.pins), so the chain an
open allocation extends went first, and a put at its tenant's quota wrote its own head down to
make room for its next batch; a WritePages stream (one page a group, each room made before its
allocation leans on anything) wrote each page's predecessor down: the put streamed through RAM.
"""

from __future__ import annotations

import secrets

from support.core_pages import LAYOUT, CorePages, in_host, page_keys
from support.servers import make_config
from support.tenants import LAYOUT as WIRE_LAYOUT
from support.tenants import PAGE_BYTES, A, Caller, new_keys, new_ns, start_with_quotas

from kvstore._proto import data_pb2
from kvstore.page import checksum
from kvstore.server.placement import Placement

pytest_plugins = ["support.tenants"]  # its ca fixture

NS = b"leaning-namespace"
PAGES = CorePages(NS)
_keys, _in_host, _allocate, _commit = page_keys, in_host, PAGES.allocate, PAGES.commit


def _read_back(core: Placement, keys: list[bytes]) -> None:
    lease, pages = core.acquire(NS, keys, 0)
    assert len(pages) == len(keys)
    core.release(lease)


def test_evict_own_passes_over_the_chain_an_open_allocation_extends(tmp_path) -> None:
    """A put's first batch of 8 committed, then 24 other pages (probation, newer than the
    put's), the put's second batch allocated (open, leaning on the first's last page): a pass
    at the tenant's quota takes 8 of the others, not the put's head, which is the least
    recently used chain."""
    core = Placement(make_config(tmp_path, host_bytes=4 << 20, allocation_ttl_ms=30_000))
    try:
        head = _keys("head", 8)
        assert _commit(core, _allocate(core, head), head) == 8
        others = [_keys(f"other{n}", 8) for n in range(3)]
        for keys in others:
            assert _commit(core, _allocate(core, keys), keys) == 8
        tail = _keys("tail", 8)
        second = _allocate(core, tail, parent=head[-1])
        assert core.evict_own(frozenset([NS]), 24 * LAYOUT.page_bytes)
        assert _in_host(core, head) == [True] * 8, "the pass at the quota wrote the put's head down"
        assert sum(_in_host(core, [k for keys in others for k in keys])) == 16
        assert _commit(core, second, tail) == 8
        assert _in_host(core, head + tail) == [True] * 16
        assert core.view().idle, core.view()
    finally:
        core.close()


def _chunks(ns: bytes, keys: list[bytes], parent: bytes = b"") -> list[data_pb2.PageChunk]:
    chunks = []
    for i, key in enumerate(keys):
        data = secrets.token_bytes(PAGE_BYTES)
        chunks.append(data_pb2.PageChunk(key=key, namespace_id=ns, layout=WIRE_LAYOUT, page_bytes=PAGE_BYTES,
                                         checksum=checksum(data), offset=0, data=data, parent=parent if i == 0 else b""))
    return chunks


def test_a_put_streamed_at_the_host_quota_keeps_its_own_pages(tmp_path, ca) -> None:
    """Tenant a, quota 28 pages: a put's first 4 pages, then 24 other pages (probation, newer
    than the put's); then the put's other 4 in a second WritePages stream naming the first's
    last page as its parent. Each page's room is made before its allocation: the put's pages
    stay, 4 of the others go."""
    server = start_with_quotas(tmp_path, ca, {"a": {"host_bytes": 28 * PAGE_BYTES}})
    try:
        a = Caller(server, ca, A)
        ns, others = new_ns(), [new_keys(8) for _ in range(3)]
        put = new_keys(8)
        assert a.data.WritePages(iter(_chunks(ns, put[:4])), metadata=a.metadata, timeout=10).num_published == 4
        for keys in others:
            assert a.put(ns, keys) == 8
        sent = a.data.WritePages(iter(_chunks(ns, put[4:], parent=put[3])), metadata=a.metadata, timeout=10)
        assert sent.num_published == 4
        host = server.core.residence
        assert [host.has(k, 0) for k in put] == [True] * 8, "the put wrote its own pages down at the quota"
        assert sum(host.has(k, 0) for keys in others for k in keys) == 20
        assert a.lookup(ns, put) == 8
        a.close()
    finally:
        server.stop(grace_s=1)
