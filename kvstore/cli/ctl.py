"""kvstore-ctl: operator commands against a running server (stats, lookup, invalidate)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import grpc

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.cli.client_args import add_client_security, client_security
from kvstore.cli.ctl_migrate import add_arguments as add_migrate_arguments
from kvstore.cli.ctl_migrate import migrate
from kvstore.config import format_size
from kvstore.errors import KVStoreError
from kvstore.keys import page_keys
from kvstore.security import authfile
from kvstore.security.channel import sync_channel
from kvstore.security.identity import Rights, check_tenant_name
from kvstore.status import error_for
from kvstore.types import KVLayout, Namespace


def _namespace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace-id", help="namespace id in hex (instead of the fields below)")
    p.add_argument("--model")
    p.add_argument("--revision", default="")
    p.add_argument("--adapter", default="")
    p.add_argument("--tenant-salt", default="")
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-tokens", type=int, default=16)


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: migrate's --to would be taken for --token
    p = argparse.ArgumentParser(prog="kvstore-ctl", description="Operate a running kvstore-server.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--server", default="127.0.0.1:7070", help="server address HOST:PORT")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds before giving up on the server")
    add_client_security(p)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("stats", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="tier usage, hits, misses, evictions")
    lk = sub.add_parser("lookup", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="how much of a token sequence is stored")
    _namespace_args(lk)
    lk.add_argument("--tokens", required=True, help="comma-separated token ids, or @FILE with a JSON list")
    inv = sub.add_parser("invalidate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         help="drop every page of a namespace (its generation goes up; in cluster mode at every node)")
    _namespace_args(inv)
    inv.add_argument("--wait", type=float, default=30.0,
                     help="seconds the server may take to have every node confirm it (a node that does not is fenced: "
                          "a lease TTL more)")
    qu = sub.add_parser("quarantine", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="pages that failed their checks (list, or --purge the list)")
    qu.add_argument("--purge", action="store_true")
    nt = sub.add_parser("new-token", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="make a random token and the --auth-file entry that grants it (no server needed)")
    nt.add_argument("--tenant", required=True)
    nt.add_argument("--rights", default="read,write", help="comma-separated: read, write, admin, node (a cluster node's right)")
    cl = sub.add_parser("cluster", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        help="members, epochs, record ownership and usage of every node (reads etcd)")
    cl.add_argument("--etcd", required=True, metavar="etcd://HOST:PORT[,HOST:PORT]", help="the cluster's etcd (as --cluster)")
    cl.add_argument("--cluster-name", default="default")
    cl.add_argument("--cluster-replicas", type=int, default=1, help="as the servers' --cluster-replicas")
    mg = sub.add_parser("migrate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        help="move a running session to another node (pre-copy, fence, delta); resumable")
    _namespace_args(mg)
    add_migrate_arguments(mg)
    plan = sub.add_parser("plan", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="rank local hit, fetch and recompute per instance (no server needed)")
    plan.add_argument("file", help="JSON request: {request, candidates, objective}; '-' for stdin")
    return p


def plan(args: argparse.Namespace) -> dict[str, Any]:
    from kvstore import planner

    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    try:
        doc = json.loads(text)
        request, candidates, objective = planner.request_from_dict(doc)
        if objective == "makespan":
            return planner.route_batch([request] * doc.get("num_requests", 1), candidates).to_dict()
        return planner.route(request, candidates, objective).to_dict()
    except (KeyError, TypeError, ValueError) as exc:
        raise KVStoreError(f"plan input: {exc}") from None


def _namespace(args: argparse.Namespace) -> tuple[bytes, int]:
    if args.namespace_id:
        try:
            ns_id = bytes.fromhex(args.namespace_id)
        except ValueError:
            raise KVStoreError("--namespace-id must be hex") from None
        return ns_id, args.page_tokens
    if not (args.model and args.layers and args.kv_heads and args.head_dim):
        raise KVStoreError("give --namespace-id, or --model with --layers, --kv-heads and --head-dim")
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, dtype=args.dtype, page_tokens=args.page_tokens)
    ns = Namespace(model=args.model, revision=args.revision, layout=layout, adapter=args.adapter, tenant_salt=args.tenant_salt)
    return ns.namespace_id, args.page_tokens


def _tokens(text: str) -> list[int]:
    if text.startswith("@"):
        return [int(t) for t in json.loads(Path(text[1:]).read_text())]
    return [int(t) for t in text.split(",") if t.strip()]


def new_token(args: argparse.Namespace) -> dict[str, Any]:
    tenant = check_tenant_name(args.tenant, "--tenant")
    rights = Rights.parse([r.strip() for r in args.rights.split(",") if r.strip()], "--rights")
    token = authfile.new_token()
    return {"token": token, "auth_file_entry": authfile.token_entry(tenant, rights, token)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.command == "plan":
        return plan(args)
    if args.command == "new-token":
        return new_token(args)
    token, tls = client_security(args)
    if args.command == "cluster":
        from kvstore.cli.ctl_cluster import cluster_status

        return cluster_status(args.etcd, args.cluster_name, args.cluster_replicas, token, tls, args.timeout)
    if args.command == "migrate":
        return migrate(args, token, tls)
    with sync_channel(args.server, token=token, tls=tls) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        try:
            if args.command == "stats":
                r = stub.Stats(directory_pb2.StatsRequest(), timeout=args.timeout)
                return {
                    "node": r.node, "entries": r.num_entries, "last_seq": r.last_seq, "leases": r.num_leases,
                    "quarantined": r.num_quarantined,
                    "ssd": dict(sorted(r.ssd.items())),
                    "tiers": [
                        {"tier": t.tier, "pages": t.num_pages, "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                         "hits": t.hits, "misses": t.misses, "evictions": t.evictions, "bytes_in": t.bytes_in, "bytes_out": t.bytes_out}
                        for t in r.tiers
                    ],
                    "tenants": {t.tenant: {"used": dict(sorted(t.used.items())), "limits": dict(sorted(t.limits.items()))}
                                for t in r.tenants},
                }
            if args.command == "quarantine":
                r = stub.Quarantine(directory_pb2.QuarantineRequest(purge=args.purge), timeout=args.timeout)
                return {"quarantined": len(r.pages), "purged": r.purged,
                        "pages": [{"key": p.key.hex(), "namespace_id": p.namespace_id.hex(), "reason": p.reason,
                                   "unix_s": p.unix_s} for p in r.pages]}
            ns_id, page_tokens = _namespace(args)
            if args.command == "lookup":
                keys = page_keys(ns_id, _tokens(args.tokens), page_tokens)
                tiers: dict[str, int] = {}
                num_pages = 0
                if keys:  # less than a page has no key, and the server refuses an empty Lookup: none is stored
                    r = stub.Lookup(directory_pb2.LookupRequest(namespace_id=ns_id, keys=keys), timeout=args.timeout)
                    num_pages = r.num_pages
                    for run in r.runs:
                        tiers[run.tier] = tiers.get(run.tier, 0) + run.num_pages
                return {"namespace_id": ns_id.hex(), "pages": num_pages, "tokens": num_pages * page_tokens,
                        "full_pages_asked": len(keys), "by_tier": tiers}
            r = stub.Invalidate(directory_pb2.InvalidateRequest(namespace_id=ns_id), timeout=max(args.timeout, args.wait))
            return {"namespace_id": ns_id.hex(), "removed": r.num_removed, "generation": r.generation}
        except grpc.RpcError as exc:
            raise error_for(exc.code(), f"{args.server}: {exc.details()}") from None


def _print_table(result: dict[str, Any]) -> None:
    tiers = result.pop("tiers", None)
    ssd = result.pop("ssd", None)
    for key, value in result.items():
        print(f"{key:>18}: {value}")
    if tiers:
        print(f"\n{'tier':<6} {'pages':>8} {'used':>10} {'capacity':>10} {'hits':>8} {'misses':>8} {'evictions':>9}")
        for t in tiers:
            print(f"{t['tier']:<6} {t['pages']:>8} {format_size(t['used_bytes']):>10} {format_size(t['capacity_bytes']):>10} "
                  f"{t['hits']:>8} {t['misses']:>8} {t['evictions']:>9}")
    if ssd:
        print("\nssd endurance")
        for key, value in ssd.items():
            print(f"{key:>32}: {value:,.3f}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except KVStoreError as exc:
        print(f"kvstore-ctl: {exc}", file=sys.stderr)
        return 1
    if args.json or args.command == "plan":
        print(json.dumps(result, indent=2))
    elif args.command == "cluster":
        from kvstore.cli.ctl_cluster import print_cluster

        print_cluster(result)
    elif args.command == "new-token":
        print(f"{result['token']}\n\n# Give the token above to the client; the server keeps only its SHA-256.\n"
              f"# Add this to the --auth-file, then send the server SIGHUP:\n{result['auth_file_entry']}", end="")
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
