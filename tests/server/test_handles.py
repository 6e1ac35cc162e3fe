"""Allocation and lease handles are 128-bit random: a caller cannot guess another's."""

from __future__ import annotations

import secrets

import grpc
import pytest
from support.kv import random_kv

from kvstore._proto import data_pb2, data_pb2_grpc, directory_pb2, directory_pb2_grpc
from kvstore.client import KVStoreClient
from kvstore.page import LayoutDesc
from kvstore.validate import layout_msg


async def test_handles_are_random_and_a_guess_touches_nothing(server, layout, ns) -> None:
    """Handles were sequential integers (1, 2, 3, ...): anyone could release or abort the
    allocation or lease made just before theirs."""
    tokens = list(range(64))
    async with KVStoreClient(server.address, ns) as client:
        await client.put(tokens, random_kv(layout, 64))
        keys = client.keys(tokens)
    with grpc.insecure_channel(server.address) as channel:
        data, directory = data_pb2_grpc.DataStub(channel), directory_pb2_grpc.DirectoryStub(channel)
        leases = [data.Acquire(data_pb2.AcquireRequest(namespace_id=ns.namespace_id, keys=keys, ttl_ms=60_000)).lease_id
                  for _ in range(3)]
        allocs = [data.Allocate(data_pb2.AllocateRequest(namespace_id=ns.namespace_id, layout=layout_msg(LayoutDesc.of(layout)),
                                                         keys=[secrets.token_bytes(16)])).allocation_id for _ in range(3)]
        for handle in leases + allocs:
            assert len(handle) == 16
        assert len(set(leases + allocs)) == 6
        assert len({int.from_bytes(h, "big") - int.from_bytes(leases[0], "big") for h in leases}) == 3
        guess = secrets.token_bytes(16)
        data.Release(data_pb2.ReleaseRequest(lease_id=guess))
        data.Abort(data_pb2.AbortRequest(allocation_id=guess))
        with pytest.raises(grpc.RpcError) as err:
            data.Renew(data_pb2.RenewRequest(lease_id=guess, ttl_ms=1000))
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert directory.Stats(directory_pb2.StatsRequest()).num_leases == 3, "a guessed handle released nothing"
        for lease in leases:
            data.Release(data_pb2.ReleaseRequest(lease_id=lease))
        for alloc in allocs:
            data.Abort(data_pb2.AbortRequest(allocation_id=alloc))
        assert directory.Stats(directory_pb2.StatsRequest()).num_leases == 0
