"""Tenants with tokens over TLS, their async clients' unary calls on the same-host call socket
(DESIGN §11): each tenant sees only its own pages, a call into another tenant's namespace fails
with the same error class as over gRPC, and no unary call goes over gRPC."""

from __future__ import annotations

import pytest
import torch
from support.kv import random_kv
from support.tenants import LAYOUT, A, B

from kvstore import KVLayout, Namespace
from kvstore._proto import data_pb2
from kvstore.client import ClientTLS, KVStoreClient
from kvstore.client.runtime import Runtime
from kvstore.errors import KVStoreError, PermissionDenied

pytest_plugins = ["support.tenants"]  # its ca and tenant_server fixtures


async def _error_of(client: KVStoreClient, coro: object) -> type[KVStoreError]:
    try:
        await client.runtime.call(coro)  # type: ignore[arg-type]
    except KVStoreError as exc:
        return type(exc)
    raise AssertionError("the call into another tenant's namespace succeeded")


async def test_tenants_stay_apart_on_the_async_call_socket(tenant_server, ca, layout: KVLayout) -> None:
    ns = Namespace("m", "r1", layout)
    tls = ClientTLS(ca=ca.cert)
    tokens = torch.arange(3 * layout.page_tokens)
    kv = random_kv(layout, len(tokens))
    async with KVStoreClient(tenant_server.address, ns, token=A, tls=tls) as alice, \
            KVStoreClient(tenant_server.address, ns, token=B, tls=tls) as bob:
        assert alice.runtime.local is not None and bob.runtime.local is not None
        grpc_calls: list[str] = []
        for client in (alice, bob):
            real = client.runtime.rpc

            async def spy(method, *args, _real=real, **kw):  # type: ignore[no-untyped-def]
                grpc_calls.append(str(method))
                return await _real(method, *args, **kw)

            client.runtime.rpc = spy  # type: ignore[method-assign]
        assert await alice.put(tokens, kv) == len(tokens)
        into = torch.zeros_like(kv)
        assert await alice.get(await alice.lookup(tokens), into) == len(tokens)
        assert torch.equal(into, kv)
        assert (await bob.lookup(tokens)).num_tokens == 0
        assert grpc_calls == []
        acquire = data_pb2.AcquireRequest(namespace_id=alice.namespace.namespace_id, keys=alice.keys(tokens), ttl_ms=1000)
        acquired = await bob.calls.unary("Data.Acquire", acquire)
        assert list(acquired.pages) == [] and acquired.page_bytes == 0
        allocate = data_pb2.AllocateRequest(namespace_id=alice.namespace.namespace_id, layout=LAYOUT, keys=alice.keys(tokens))
        over_socket = await _error_of(bob, bob.calls.unary("Data.Allocate", allocate))
        assert grpc_calls == []
        over_grpc = await _error_of(bob, bob.runtime.rpc(bob.runtime.data.Allocate, allocate))
        assert over_socket is over_grpc is PermissionDenied


async def test_lookups_on_the_callers_loop_are_the_tenants(tenant_server, ca, layout: KVLayout,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup runs on the caller's loop over a channel of its own (client/calls.py): it says
    HELLO with the client's token, so a tenant sees its own pages there and no other's."""
    ns = Namespace("m", "r1", layout)
    tls = ClientTLS(ca=ca.cert)
    tokens = torch.arange(2 * layout.page_tokens)
    async with KVStoreClient(tenant_server.address, ns, token=A, tls=tls) as alice, \
            KVStoreClient(tenant_server.address, ns, token=B, tls=tls) as bob:
        assert await alice.put(tokens, random_kv(layout, len(tokens))) == len(tokens)
        hops: list[object] = []
        real = Runtime.call

        async def hop(runtime: Runtime, coro: object) -> object:
            hops.append(coro)
            return await real(runtime, coro)  # type: ignore[arg-type]

        monkeypatch.setattr(Runtime, "call", hop)
        assert (await alice.lookup_keys(alice.keys(tokens))).num_tokens == len(tokens)  # read as alice
        assert (await bob.lookup(tokens)).num_tokens == 0
        assert hops == []
