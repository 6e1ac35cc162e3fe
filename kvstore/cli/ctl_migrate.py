"""``kvstore-ctl migrate``: moves a running session from the node ``--server`` names to node
``--to`` (DESIGN §12.8), through KVStoreClient.migrate, and prints the
summary: rounds, bytes per round, the pause, the total."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kvstore.config import parse_size
from kvstore.errors import KVStoreError
from kvstore.security.channel import ClientTLS
from kvstore.types import KVLayout, Namespace


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags after the namespace's (ctl's _namespace_args: the layout is needed, not only an id)."""
    p.add_argument("--session", required=True, help="the session id (its token log is at --server)")
    p.add_argument("--to", required=True, metavar="NODE", help="the target node's id")
    p.add_argument("--to-address", help="the target's HOST:PORT (default: as --server knows it)")
    # defaults: KVStoreClient.migrate's (not imported here: kvstore-ctl does not load the client for other commands)
    p.add_argument("--max-pause-bytes", help="fence once at most this much stored KV is not copied yet (the pause's "
                   "bytes; default 64MiB)")
    p.add_argument("--max-pause-ms", type=float, help="instead: fence once the rest copies within this, at the best "
                   "copy rate a round showed")
    p.add_argument("--max-rounds", type=int, help="pre-copy rounds before giving up (default 32)")
    p.add_argument("--stall-rounds", type=int, help="rounds in a row whose rest did not shrink before 'cannot converge' "
                   "(default 3)")
    p.add_argument("--abort", action="store_true", help="give up a migration not fenced yet (the source keeps the session)")
    p.add_argument("--force", metavar="SOURCE", help="the session's source SOURCE is gone (not a member): --server, the "
                   "target --to, takes the session over with what it copied (tokens logged after the last round are lost)")


def migrate(args: argparse.Namespace, token: str | None, tls: ClientTLS | None) -> dict[str, Any]:
    from kvstore.client import KVStoreClient

    if not (args.model and args.layers and args.kv_heads and args.head_dim):
        raise KVStoreError("migrate needs --model with --layers, --kv-heads and --head-dim (the client computes page keys)")
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, dtype=args.dtype, page_tokens=args.page_tokens)
    ns = Namespace(model=args.model, revision=args.revision, layout=layout, adapter=args.adapter, tenant_salt=args.tenant_salt)

    async def run() -> dict[str, Any]:
        async with KVStoreClient(args.server, ns, use_shm=False, timeout_s=args.timeout, token=token, tls=tls) as client:
            if args.force:
                if client.node != args.to:
                    raise KVStoreError(f"--force: --server must be the target {args.to!r}, not {client.node!r}")
                return (await client.take_over(args.session, args.force)).as_dict()
            given: dict[str, Any] = {"max_pause_ms": args.max_pause_ms, "max_rounds": args.max_rounds,
                                     "stall_rounds": args.stall_rounds}
            if args.max_pause_bytes is not None:
                given["max_pause_bytes"] = parse_size(args.max_pause_bytes, "--max-pause-bytes")
            summary = await client.migrate(args.session, args.to, abort=args.abort, target_address=args.to_address,
                                           **{k: v for k, v in given.items() if v is not None})
            return {"aborted": True, **summary.as_dict()} if args.abort else summary.as_dict()

    return asyncio.run(run())
