"""A raw UCX client that is not a node (no grant from the control plane) as a child process:
connects to a node's data port and asks for pages by namespace id and key, as anyone who
reaches the port could. Prints one JSON line: the status of each page and the checksum of
the bytes that arrived (so the test can compare them with the stored page).

    python tests/cluster/raw_ucx_fetch.py HOST:PORT GRANT_HEX|- NAMESPACE_HEX PAGE_BYTES KEY_HEX [KEY_HEX ...]

GRANT_HEX: a grant to present (a forged one, say); ``-``: none; ``idle [N]``: open N connections
(default 1), send nothing until the node has closed every one of them (IDLE_S seconds at most),
print ``idle`` and exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from kvstore.cluster import transport_ucx  # before ucxx itself: it points UCX's log away from stdout
from kvstore.cluster.transport_ucx import UcxConfig, UcxPageFetcher, init_ucx
from kvstore.page import checksum

IDLE_S = 7.0  # past the page server's HELLO_TIMEOUT_S: the longest an idle connection is held open


async def idle(address: str, count: int) -> None:
    host, _, port = address.rpartition(":")
    init_ucx(UcxConfig(tls="tcp", progress_mode="thread"))
    eps = [await transport_ucx.ucxx.create_endpoint(host, int(port)) for _ in range(count)]
    deadline = time.monotonic() + IDLE_S
    while time.monotonic() < deadline and not all(ep.closed for ep in eps):  # the node dropped them all: done
        await asyncio.sleep(0.05)
    for ep in eps:
        ep.abort()
    print("idle", flush=True)


async def main(address: str, grant: bytes | None, namespace_id: bytes, page_bytes: int, keys: list[bytes]) -> None:
    host, _, port = address.rpartition(":")

    async def present() -> bytes:
        assert grant is not None
        return grant

    fetcher = UcxPageFetcher(host, int(port), UcxConfig(tls="tcp", progress_mode="thread"), None if grant is None else present)
    dests = [bytearray(page_bytes) for _ in keys]
    result = await fetcher.fetch(namespace_id, keys, dests, timeout_s=5)
    print(json.dumps({"statuses": [s.value for s in result.statuses], "checksums": [checksum(d) for d in dests],
                      "error": result.error}), flush=True)


if __name__ == "__main__":
    if sys.argv[2] == "idle":
        asyncio.run(idle(sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 else 1))
        os._exit(0)
    grant = None if sys.argv[2] == "-" else bytes.fromhex(sys.argv[2])
    asyncio.run(main(sys.argv[1], grant, bytes.fromhex(sys.argv[3]), int(sys.argv[4]), [bytes.fromhex(k) for k in sys.argv[5:]]))
    os._exit(0)  # the answer is out; UCX's notifier thread (thread progress mode) may hold up an orderly exit
