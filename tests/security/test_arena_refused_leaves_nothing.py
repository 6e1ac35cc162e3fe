"""With an arena per tenant (DESIGN §6, §11) a read makes no arena but the caller's own: reading a
namespace nobody has written (bound to no tenant: its pages would be the unbound owner's) must not
make an arena for that owner, reserved in full (--host-capacity without a host_bytes quota) and
mapped by nobody; and a read refused because the caller's own arena cannot be made (the host's
memory cannot hold it: RESOURCE_EXHAUSTED) leaves no lease behind (a rejected request leaves no
pin, slot or binding)."""

from __future__ import annotations

import grpc
import pytest
from support.tenants import B, Caller, new_keys, new_ns

from kvstore._proto import data_pb2
from kvstore.errors import ConfigError

pytest_plugins = ["support.tenants"]  # its ca and tenant_server fixtures


def _arena_owners(server) -> list[str]:
    return sorted(part.owner for part in server.core.landing.parts())


def test_reading_a_namespace_nobody_wrote_makes_no_arena_but_the_callers(tenant_server, ca) -> None:
    b = Caller(tenant_server, ca, B)
    try:
        assert _arena_owners(tenant_server) == []
        request = data_pb2.AcquireRequest(namespace_id=new_ns(), keys=new_keys(2))
        assert b(b.data.Acquire, request).pages == []
        assert b.stream(b.data.ReadPages, data_pb2.ReadPagesRequest(namespace_id=new_ns(), keys=new_keys(2))) == []
        assert _arena_owners(tenant_server) == ["b"]  # its own, whose token Acquire answers
    finally:
        b.close()


def _no_memory(arena_bytes: int, lower: str) -> None:
    raise ConfigError(f"a {arena_bytes >> 20} MiB arena does not fit in the 0 MiB of memory available (lower {lower})")


def test_an_acquire_refused_for_want_of_the_callers_arena_holds_no_lease(tenant_server, ca,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvstore.tiers.host._check_memory", _no_memory)  # no new arena fits
    b = Caller(tenant_server, ca, B)
    try:
        request = data_pb2.AcquireRequest(namespace_id=new_ns(), keys=new_keys(2))
        assert b.code(b.data.Acquire, request) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert tenant_server.core.view().lease_ids == frozenset()
        assert tenant_server.core.leases.held("b") == (0, 0)
    finally:
        b.close()
