"""How long a fresh node takes to join a cluster whose etcd holds N namespace generation records
(DESIGN §12.5: it enters every one before it serves), and whether it joins at all within its join
timeout. One line per run: records, joined or not, seconds to ready, the catch-up's seconds (its
log, from registration to "caught up"), how many generations its directory holds when it stops.

    python -m kvstore.bench.cluster.cluster_join --generations 30000 --ttl 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from datetime import datetime
from pathlib import Path

import lmdb

from kvstore.bench.common.cluster_procs import Etcd, Node
from kvstore.cluster.etcd import EtcdClient, parse_endpoints

TXN_OPS = 48  # below etcd's default --max-txn-ops (128)
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


async def fill(url: str, cluster: str, count: int) -> None:
    client = EtcdClient(parse_endpoints(url), call_timeout_s=10.0)
    prefix = f"/kvstore/{cluster}/generations/".encode()
    value = json.dumps({"generation": 3, "issued_by": "filler", "issued_at_s": 0.0}).encode()
    try:
        keys = [prefix + i.to_bytes(16, "big").hex().encode() for i in range(count)]
        for start in range(0, count, TXN_OPS):
            assert await client.put_if([(k, value, 0) for k in keys[start : start + TXN_OPS]], {})
    finally:
        await client.close()


def _at(line: str) -> float | None:
    found = _STAMP.match(line)
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if found else None


def catch_up_s(log: Path) -> float | None:
    """From the last registration to the catch-up that followed it, as the node logged them."""
    registered = caught = None
    for line in log.read_text(errors="replace").splitlines():
        if " registered: epoch " in line:
            registered, caught = _at(line), None
        elif "caught up with etcd's generations" in line and registered is not None:
            caught = _at(line)
    return caught - registered if registered is not None and caught is not None else None


def entered(data_dir: Path) -> int:
    env = lmdb.open(str(data_dir / "directory.lmdb"), readonly=True, max_dbs=6, lock=False)
    try:
        with env.begin() as txn:
            return txn.stat(env.open_db(b"generations", txn=txn))["entries"]
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=30_000)
    parser.add_argument("--ttl", type=int, default=2)
    parser.add_argument("--join-timeout-s", type=float, default=0.0, help="the node's (0: its default, 3 TTLs, at least 10 s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-join-") as tmp:
        workdir = Path(tmp)
        etcd = Etcd(workdir)
        try:
            asyncio.run(fill(etcd.url, "join", args.generations))
            node = Node(workdir, "a", etcd, "join", "grpc", args.ttl, "64MiB")
            node.args[node.args.index("--log-level") + 1] = "info"
            node.args += ["--cluster-join-timeout-s", str(args.join_timeout_s)]
            started = time.monotonic()
            node.launch()
            try:
                node.wait_ready()
                ready_s: float | None = time.monotonic() - started
            except RuntimeError:
                ready_s = None
            node.stop()
            log = node.dir / "server.log"
            lost = log.read_text(errors="replace").count("stops acting as a member")
            caught = catch_up_s(log)
            print(f"generations={args.generations} ttl_s={args.ttl} joined={ready_s is not None} "
                  f"ready_s={ready_s if ready_s is None else round(ready_s, 2)} "
                  f"catch_up_s={caught if caught is None else round(caught, 2)} entered={entered(node.dir / 'data')} "
                  f"memberships_lost={lost}")
        finally:
            etcd.stop()


if __name__ == "__main__":
    main()
