"""hbm above per-tenant arenas: each tenant's pages are promoted into its own pool (another
tenant's reads never push them out), a page demoted from it goes back into its owner's arena
(never another tenant's, never the unowned one), and its owner reads it bit-exact there."""

from __future__ import annotations

import dataclasses

import grpc
import torch
from support.certs import CertAuthority
from support.kv import random_kv
from support.tenants import A, B, tenant_config

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import ClientTLS, KVStoreClient
from kvstore.config import HbmTierConfig
from kvstore.device_ops import CpuOps
from kvstore.server import Server
from kvstore.tiers.arenas import ARENA_BITS
from kvstore.types import Namespace

pytest_plugins = ["support.tenants"]


async def test_a_page_demoted_from_hbm_goes_back_into_its_owners_arena(tmp_path, ca: CertAuthority, layout) -> None:
    config = dataclasses.replace(tenant_config(tmp_path, ca), tiers=("hbm", "host", "ssd"),
                                 hbm=HbmTierConfig(capacity_bytes=1 << 20, slab_bytes=1 << 20, device="cpu"))
    server = Server(config)
    server.start()
    tls = ClientTLS(ca=ca.cert)
    ns = Namespace("m", "r1", layout)
    a_tokens, a2_tokens, b_tokens = list(range(256)), list(range(20_000, 20_512)), list(range(10_000, 10_512))
    a_kv, a2_kv, b_kv = random_kv(layout, 256, seed=1), random_kv(layout, 512, seed=3), random_kv(layout, 512, seed=2)

    async def on_device(client: KVStoreClient, tokens: list[int], kv: torch.Tensor) -> None:
        load = client.load(await client.lookup(tokens), into=torch.zeros_like(kv), ahead=1, deadline_s=30,
                           device_ops=CpuOps())
        await load.finished()  # an engine's read on its device: promoted into its tenant's pool

    try:
        async with KVStoreClient(server.address, ns, token=A, tls=tls) as alice, \
                KVStoreClient(server.address, ns, token=B, tls=tls) as bob:
            await alice.put(a_tokens, a_kv)
            a_hit = await alice.lookup(a_tokens)
            a_arena = {server.core.where(k)["host"] >> ARENA_BITS for k in a_hit.keys}
            await on_device(alice, a_tokens, a_kv)
            channel = grpc.aio.secure_channel(server.address, grpc.ssl_channel_credentials(ca.cert.read_bytes()))
            async with channel:
                await directory_pb2_grpc.DirectoryStub(channel).Remove(
                    directory_pb2.RemoveRequest(namespace_id=a_hit.namespace_id, keys=a_hit.keys, tier="host"),
                    metadata=[("authorization", f"Bearer {A}")])
            assert all(set(server.core.where(k)) == {"hbm"} for k in a_hit.keys)
            await bob.put(b_tokens, b_kv)
            await on_device(bob, b_tokens, b_kv)  # fills B's pool
            assert all(set(server.core.where(k)) == {"hbm"} for k in a_hit.keys), "B's reads never evict A's pages"
            await alice.put(a2_tokens, a2_kv)
            await on_device(alice, a2_tokens, a2_kv)  # fills A's pool: A's first pages go down
            assert all(set(server.core.where(k)) == {"host"} for k in a_hit.keys), "hbm -> host demotion"
            assert {server.core.where(k)["host"] >> ARENA_BITS for k in a_hit.keys} == a_arena, "into A's own arena"
            out = torch.zeros_like(a_kv)
            await alice.get(await alice.lookup(a_tokens), into=out)
            assert torch.equal(out, a_kv)
    finally:
        server.stop(grace_s=1)
