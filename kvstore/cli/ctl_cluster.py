"""kvstore-ctl cluster: the members etcd lists (address, epoch), the share of page records
each owns (rendezvous over the live members, measured on a sample of keys), and each
node's usage from its Stats RPC. Imported only by that command (it needs the cluster extra)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import grpc

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.cluster.etcd import EtcdClient, parse_endpoints
from kvstore.cluster.members import Member
from kvstore.cluster.shards import ShardConfig, ShardMap
from kvstore.config import format_size
from kvstore.security.channel import ClientTLS, sync_channel

SAMPLE_KEYS = 4096


async def _read_etcd(url: str, cluster: str, timeout_s: float) -> tuple[list[Member], dict[str, int], int]:
    etcd = EtcdClient(parse_endpoints(url), call_timeout_s=timeout_s)
    root = f"/kvstore/{cluster}/".encode()
    try:
        _, kvs = await etcd.get_prefix(root)
    finally:
        await etcd.close()
    members, epochs, invalidations = [], {}, 0
    for kv in kvs:
        kind, _, name = kv.key[len(root):].decode(errors="replace").partition("/")
        if kind == "nodes":
            members.append(Member.from_json(kv.value))
        elif kind == "epochs":
            epochs[name] = int(kv.value)
        elif kind == "invalidations":
            invalidations += 1
    return sorted(members, key=lambda m: m.node_id), epochs, invalidations


def _usage(member: Member, token: str | None, tls: ClientTLS | None, timeout_s: float) -> dict[str, Any]:
    try:
        with sync_channel(member.grpc_address, token=token, tls=tls) as channel:
            r = directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        return {"reachable": False, "error": f"{exc.code().name}: {exc.details()}"}
    tiers = {t.tier: {"pages": t.num_pages, "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes} for t in r.tiers}
    return {"reachable": True, "entries": r.num_entries, "leases": r.num_leases, "tiers": tiers}


def cluster_status(url: str, cluster: str, replicas: int, token: str | None, tls: ClientTLS | None,
                   timeout_s: float) -> dict[str, Any]:
    members, epochs, invalidations = asyncio.run(_read_etcd(url, cluster, timeout_s))
    shard_map = ShardMap([m.node_id for m in members], ShardConfig(segment_pages=1, replicas=replicas))
    owned = dict.fromkeys(shard_map.members, 0)
    for _ in range(SAMPLE_KEYS):
        for owner in shard_map.owners(os.urandom(16)):
            owned[owner] += 1
    return {
        "cluster": cluster,
        "members": [
            {"node": m.node_id, "epoch": m.epoch, "grpc": m.grpc_address, "data": m.data_address or "(grpc)",
             "record_share": round(owned.get(m.node_id, 0) / SAMPLE_KEYS, 3), **_usage(m, token, tls, timeout_s)}
            for m in members
        ],
        "registered_before": {node: epoch for node, epoch in sorted(epochs.items()) if node not in owned},
        "invalidations": invalidations,
    }


def print_cluster(result: dict[str, Any]) -> None:
    print(f"cluster {result['cluster']}: {len(result['members'])} members, {result['invalidations']} namespace invalidations")
    print(f"\n{'node':<12} {'epoch':>5} {'grpc':<22} {'data':<22} {'records':>7} {'entries':>8} {'leases':>6} "
          f"{'host used':>10} {'ssd used':>10}")
    for m in result["members"]:
        tiers = m.get("tiers", {})
        used = [format_size(tiers[t]["used_bytes"]) if t in tiers else "-" for t in ("host", "ssd")]
        entries = m.get("entries", "down")
        print(f"{m['node']:<12} {m['epoch']:>5} {m['grpc']:<22} {m['data']:<22} {m['record_share']:>7.1%} {entries!s:>8} "
              f"{m.get('leases', '-')!s:>6} {used[0]:>10} {used[1]:>10}")
    if result["registered_before"]:
        print("\nnot live now (last epoch): " + json.dumps(result["registered_before"]))
