"""kvstore-bench cluster-balance: how evenly the sharded directory spreads lookups, by
simulation on a Mooncake-format trace (no servers; the real shard code, DESIGN §12).

Every request's chain of 512-token blocks (``hash_ids``; equal ids mean a shared prefix) is
looked up once: the chain is cut into segments of ``segment_tokens``, each segment's owner is
the rendezvous winner of its first key over N members, and a lookup is one RPC per distinct
owner. Reported per N and segment size: the busiest node's lookup RPCs over the mean
(max/mean), owners touched per lookup (median, p90, max), and the share of the trace's
segments that move when one member joins (rendezvous promises 1/(N+1)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from kvstore.bench.main import run_alone
from kvstore.cluster.shards import ShardConfig, ShardMap, moves, plan_lookup

BLOCK_TOKENS = 512  # the trace's block


def load_chains(path: str, limit: int = 0) -> list[list[bytes]]:
    chains = []
    with open(path) as f:
        for line in f:
            if line.strip():
                chains.append([int(h).to_bytes(16, "little") for h in json.loads(line)["hash_ids"]])
                if limit and len(chains) >= limit:
                    break
    return chains


def simulate(chains: list[list[bytes]], num_nodes: int, segment_tokens: int, replicas: int = 1) -> dict[str, Any]:
    """Lookup load per node and fan-out per lookup for one cluster size and segment size."""
    if segment_tokens % BLOCK_TOKENS:
        raise ValueError(f"segment_tokens must be a multiple of {BLOCK_TOKENS}")
    nodes = [f"node-{i}" for i in range(num_nodes)]
    config = ShardConfig(segment_pages=segment_tokens // BLOCK_TOKENS, replicas=replicas)
    shard_map = ShardMap(nodes, config)
    rpcs = dict.fromkeys(nodes, 0)
    fanout: list[int] = []
    segment_keys: set[bytes] = set()
    for chain in chains:
        if not chain:
            continue
        plan = plan_lookup(chain, shard_map)
        owners = plan.requests()
        for owner in owners:
            rpcs[owner] += 1
        fanout.append(len(owners))
        segment_keys.update(seg.key for seg in plan.segments)
    grown = ShardMap([*nodes, "node-new"], config)
    moved = len(moves(segment_keys, shard_map, grown))
    mean = sum(rpcs.values()) / num_nodes
    fanout.sort()
    return {
        "nodes": num_nodes, "segment_tokens": segment_tokens, "replicas": replicas, "lookups": len(fanout),
        "max_over_mean": round(max(rpcs.values()) / mean, 3) if mean else 0.0,
        "max_rpcs": max(rpcs.values()), "mean_rpcs": round(mean, 1),
        "owners_median": statistics.median(fanout) if fanout else 0,
        "owners_p90": fanout[int(0.9 * (len(fanout) - 1))] if fanout else 0, "owners_max": fanout[-1] if fanout else 0,
        "join_moved": round(moved / len(segment_keys), 4) if segment_keys else 0.0,
        "join_expected": round(1 / (num_nodes + 1), 4),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL (hash_ids per 512-token block)")
    p.add_argument("--nodes", default="3,16,100", help="cluster sizes, comma-separated")
    p.add_argument("--segment-tokens", default="1024,4096", help="segment sizes in tokens, comma-separated")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--limit", type=int, default=0, help="first N requests only (0: all)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    chains = load_chains(args.trace, args.limit)
    rows = [simulate(chains, int(n), int(s), args.replicas)
            for s in args.segment_tokens.split(",") for n in args.nodes.split(",")]
    return {"trace": args.trace, "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"lookup load on the sharded directory, trace {report['trace']}")
    print(f"{'seg tokens':>10} {'nodes':>5} {'lookups':>8} {'max/mean':>8} {'owners p50':>10} {'p90':>4} {'max':>4} "
          f"{'join moved':>10} {'1/(N+1)':>8}")
    for r in report["rows"]:
        print(f"{r['segment_tokens']:>10} {r['nodes']:>5} {r['lookups']:>8} {r['max_over_mean']:>8.2f} "
              f"{r['owners_median']:>10} {r['owners_p90']:>4} {r['owners_max']:>4} {r['join_moved']:>10.3f} "
              f"{r['join_expected']:>8.3f}")


def main(argv: list[str] | None = None) -> None:
    run_alone(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
