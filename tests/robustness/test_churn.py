"""Seeded random churn against a reference model (DESIGN §12: the sharded directory gets the
treatment etcd's robustness suite gives etcd). Puts, reads and namespace invalidations at
random live nodes while nodes are SIGKILLed, restarted on their data and a new one joins.
After every read: what came back is bit-exact or missing, never wrong, and nothing of a prefix
put before an acknowledged invalidation is served, at any node, ever again. After the churn: a
prefix whose holder is alive and kept it (RAM and never killed since, or durable) and that no
invalidation may have touched is found whole from every live node, lookups name live nodes
only, and no node holds a lease."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import torch
from support.cluster_nodes import LAYOUT, NS, TTL_S, Node, cluster_nodes_fixture, eventually, tokens_of  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv

from kvstore._proto import directory_pb2
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError, PageMissing

SEED = 1717
STEPS = 150
BUDGET_S = 45.0  # the churn stops here, whatever step it is at (the whole test stays under a minute)


@dataclass
class Stored:
    tokens: list[int]
    kv: torch.Tensor
    holder: str
    durable: bool
    lost: bool = False  # its holder was killed after the put and it was in RAM only
    invalidated: bool = False  # an acknowledged invalidation came after it: never served again
    maybe_invalidated: bool = False  # an invalidation that was not acknowledged came after it

async def test_random_kills_restarts_and_a_join_never_serve_a_wrong_byte(cluster_nodes, etcd, tmp_path) -> None:
    rng = random.Random(SEED)
    nodes = {n.name: n for n in cluster_nodes(["n1", "n2", "n3"], "grpc")}
    live, dead, stored = set(nodes), set[str](), list[Stored]()
    started, reads, served, churned = time.monotonic(), 0, 0, []
    for step in range(STEPS):
        if time.monotonic() - started > BUDGET_S:
            break
        op = rng.choices(["put", "read", "kill", "restart", "join", "invalidate"], weights=[5, 8, 1, 1, 1, 1])[0]
        if op == "kill" and len(live) > 2:
            name = rng.choice(sorted(live))
            nodes[name].kill()
            churned.append(f"kill {name}")
            live.discard(name)
            dead.add(name)
            for s in stored:
                s.lost |= s.holder == name and not s.durable
        elif op == "restart" and dead:
            name = rng.choice(sorted(dead))
            nodes[name].start()  # same ports and data: its SSD pages are published again
            churned.append(f"restart {name}")
            dead.discard(name)
            live.add(name)
        elif op == "join" and "n4" not in nodes:
            nodes["n4"] = cluster_nodes(["n4"], "grpc")[0]
            churned.append("join n4")
            live.add("n4")
        elif op == "invalidate" and stored:
            name = rng.choice(sorted(live))
            try:
                async with KVStoreClient(nodes[name].address, NS) as client:
                    await client.invalidate()  # every node entered it (or was fenced) when this returns
                churned.append(f"invalidate at {name}")
                for s in stored:
                    s.invalidated = True
            except KVStoreError:  # not confirmed: it may stand at some nodes
                churned.append(f"invalidate at {name} (unconfirmed)")
                for s in stored:
                    s.maybe_invalidated = True
        elif op == "put" or not stored:
            name = rng.choice(sorted(live))
            tokens = tokens_of(SEED * 1000 + step, rng.randint(2, 8))
            kv = random_kv(LAYOUT, len(tokens), seed=step)
            durable = rng.random() < 0.4
            async with KVStoreClient(nodes[name].address, NS) as client:
                assert await client.put(tokens, kv, durable=durable) == len(tokens)
            stored.append(Stored(tokens, kv, name, durable))
        else:
            name, entry = rng.choice(sorted(live)), rng.choice(stored)
            reads += 1
            served += await _read_checked(nodes[name], entry)
    print(f"churn: {len(stored)} puts, {reads} reads ({served} tokens served), {', '.join(churned)}; live {sorted(live)}, "
          f"dead {sorted(dead)}, {time.monotonic() - started:.1f} s")

    for name in sorted(live):
        async with KVStoreClient(nodes[name].address, NS) as client:
            for entry in stored:
                if entry.holder in live and not (entry.lost or entry.invalidated or entry.maybe_invalidated):
                    await eventually(lambda c=client, e=entry: _found(c, e.tokens), 2 * TTL_S + 5,
                                     f"prefix of {entry.holder} from {name}")
                await eventually(lambda c=client, e=entry: _names_live(c, e.tokens, live), TTL_S + 2,
                                 f"lookups at {name} naming live nodes only")
                await _read_checked(nodes[name], entry, client)
            await eventually(lambda c=client: _no_leases(c), 5, f"no lease left at {name}")


async def _read_checked(node: Node, entry: Stored, client: KVStoreClient | None = None) -> int:
    """Reads ``entry`` at ``node`` (through ``client`` when given, a client of that node; else a
    new one): the tokens served must be bit-exact. Returns how many."""
    if client is None:
        async with KVStoreClient(node.address, NS) as fresh:
            return await _read_checked(node, entry, fresh)
    hit = await client.lookup(entry.tokens)
    out = torch.zeros_like(entry.kv)
    try:
        n = await client.get(hit, out)
    except PageMissing as missing:
        n = missing.num_tokens  # type: ignore[attr-defined]
    except KVStoreError:
        n = 0
    assert torch.equal(out[:, :, :n], entry.kv[:, :, :n]), f"wrong bytes served at {node.name}"
    assert not (entry.invalidated and n), f"{node.name} served {n} tokens of a prefix invalidated after it was put"
    return n


async def _found(client: KVStoreClient, tokens: list[int]) -> bool:
    return (await client.lookup(tokens)).num_tokens == len(tokens)


async def _names_live(client: KVStoreClient, tokens: list[int], live: set[str]) -> bool:
    return {r.node for r in (await client.lookup(tokens)).runs} <= live


async def _no_leases(client: KVStoreClient) -> bool:
    await asyncio.sleep(0)
    return (await client._call(client.runtime.directory.Stats, directory_pb2.StatsRequest())).num_leases == 0
