"""Layer-wise loads and saves that end badly: closed mid-save, failed, past their deadline,
outliving their lease, or copying a slot that changed under them. Each checks that nothing
wrong is reported valid and nothing is left behind."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from conftest import random_kv

from kvstore._proto import data_pb2, data_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
async def test_closing_the_client_mid_save_publishes_nothing(server, layout, ns, use_shm) -> None:
    """Issue 13 item 3: closing the client during a layer-wise save marked every layer done,
    so 64 tokens were published with layers 1..N never computed (zeros, checksum-clean)."""
    tokens = list(range(64))
    kv = torch.zeros(layout.num_layers, layout.kv_factor, 64, layout.num_kv_heads, layout.head_dim, dtype=layout.torch_dtype())
    kv[0] = random_kv(layout, 64, seed=31)[0]  # the engine computed layer 0 only
    before = server.manager.host.usage()
    client = KVStoreClient(server.address, ns, use_shm=use_shm)
    await client.connect()
    save = client.save(tokens, kv)
    save.layer_done(0)
    await client.close()
    async with KVStoreClient(server.address, ns) as reader:
        assert (await reader.lookup(tokens)).num_tokens == 0, "layers the engine never computed were published"
    assert server.manager.host.usage() == before, "the abandoned save left slots allocated"
    with pytest.raises(KVStoreError, match="abandoned"):
        await save.finished()


async def test_renew_extends_a_lease_and_refuses_a_gone_one(server, layout, ns) -> None:
    """Renew keeps a lease past its first ttl; a released lease or an out-of-range ttl is
    refused with a clear status and changes nothing."""
    tokens = list(range(32))
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, random_kv(layout, 32, seed=37))
        keys = client.keys(tokens)
    with grpc.insecure_channel(server.address) as channel:
        data = data_pb2_grpc.DataStub(channel)
        acq = data.Acquire(data_pb2.AcquireRequest(namespace_id=ns.namespace_id, keys=keys, ttl_ms=200), timeout=10)
        assert len(acq.pages) == 2
        data.Renew(data_pb2.RenewRequest(lease_id=acq.lease_id, ttl_ms=5000), timeout=10)
        await asyncio.sleep(0.4)  # past the first ttl
        server.manager.stats()  # reaps what has expired
        assert set(server.manager._pins) == set(keys), "a renewed lease expired at its first ttl"
        with pytest.raises(grpc.RpcError) as err:
            data.Renew(data_pb2.RenewRequest(lease_id=acq.lease_id, ttl_ms=server.config.max_lease_ms + 1), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        data.Release(data_pb2.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
        assert not server.manager._pins
        with pytest.raises(grpc.RpcError) as err:
            data.Renew(data_pb2.RenewRequest(lease_id=acq.lease_id, ttl_ms=5000), timeout=10)
        assert err.value.code() == grpc.StatusCode.ABORTED and "released or has expired" in (err.value.details() or "")
        assert not server.manager._pins, "renewing a gone lease pinned something"
