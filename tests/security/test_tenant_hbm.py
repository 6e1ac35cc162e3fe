"""hbm above per-tenant arenas: a page demoted from hbm goes back into its owner's arena
(never another tenant's, never the unowned one), and its owner reads it bit-exact there."""

from __future__ import annotations

import dataclasses

import grpc
import torch
from certs import CertAuthority
from conftest import random_kv
from tenants import A, B, tenant_config

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.client import ClientTLS, KVStoreClient
from kvstore.config import HbmTierConfig
from kvstore.server import Server
from kvstore.tiers.arenas import ARENA_BITS
from kvstore.types import Namespace

pytest_plugins = ["tenants"]


async def test_a_page_demoted_from_hbm_goes_back_into_its_owners_arena(tmp_path, ca: CertAuthority, layout) -> None:
    config = dataclasses.replace(tenant_config(tmp_path, ca), tiers=("hbm", "host", "ssd"),
                                 hbm=HbmTierConfig(capacity_bytes=1 << 20, slab_bytes=1 << 20, device="cpu"))
    server = Server(config)
    server.start()
    tls = ClientTLS(ca=ca.cert)
    ns = Namespace("m", "r1", layout)
    a_tokens, b_tokens = list(range(256)), list(range(10_000, 10_512))
    a_kv, b_kv = random_kv(layout, 256, seed=1), random_kv(layout, 512, seed=2)
    try:
        async with KVStoreClient(server.address, ns, token=A, tls=tls) as alice, \
                KVStoreClient(server.address, ns, token=B, tls=tls) as bob:
            await alice.put(a_tokens, a_kv)
            a_hit = await alice.lookup(a_tokens)
            a_arena = {server.core.where(k)["host"] >> ARENA_BITS for k in a_hit.keys}
            await alice.get(a_hit, into=torch.zeros_like(a_kv))  # promoted into hbm
            channel = grpc.aio.secure_channel(server.address, grpc.ssl_channel_credentials(ca.cert.read_bytes()))
            async with channel:
                await directory_pb2_grpc.DirectoryStub(channel).Remove(
                    directory_pb2.RemoveRequest(namespace_id=a_hit.namespace_id, keys=a_hit.keys, tier="host"),
                    metadata=[("authorization", f"Bearer {A}")])
            assert all(set(server.core.where(k)) == {"hbm"} for k in a_hit.keys)
            await bob.put(b_tokens, b_kv)
            await bob.get(await bob.lookup(b_tokens), into=torch.zeros_like(b_kv))  # fills hbm: A's pages go down
            assert all(set(server.core.where(k)) == {"host"} for k in a_hit.keys), "hbm -> host demotion"
            assert {server.core.where(k)["host"] >> ARENA_BITS for k in a_hit.keys} == a_arena, "into A's own arena"
            out = torch.zeros_like(a_kv)
            await alice.get(await alice.lookup(a_tokens), into=out)
            assert torch.equal(out, a_kv)
    finally:
        server.stop(grace_s=1)
