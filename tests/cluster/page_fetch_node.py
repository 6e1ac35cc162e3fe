"""A UCX page fetcher as a child process (to use transports other than the test process's):
fetches NUM_PAGES synthetic pages from PORT into slots of a shared-memory arena, checks them
bit-exact against page_server_node.expected_page, prints ``ok <pages>`` or the failure.

    python tests/cluster/page_fetch_node.py PORT PAGE_BYTES NUM_PAGES TLS PROGRESS_MODE
"""

from __future__ import annotations

import asyncio
import sys
from multiprocessing import shared_memory

import numpy as np
from page_server_node import expected_page

from kvstore.cluster.transport_ucx import FetchStatus, UcxConfig, UcxPageFetcher


async def main(port: int, page_bytes: int, num_pages: int, tls: str, progress_mode: str) -> None:
    arena = shared_memory.SharedMemory(create=True, size=page_bytes * num_pages)
    try:
        slots = [arena.buf[i * page_bytes:(i + 1) * page_bytes] for i in range(num_pages)]
        keys = [bytes([1]) + i.to_bytes(15, "little") for i in range(num_pages)]
        fetcher = UcxPageFetcher("127.0.0.1", port, UcxConfig(tls=tls, progress_mode=progress_mode))
        result = await fetcher.fetch(bytes(16), keys, slots, timeout_s=30)
        bad = [i for i, (k, s) in enumerate(zip(keys, slots)) if not np.array_equal(np.frombuffer(s, np.uint8),
                                                                                     expected_page(k, page_bytes))]
        await fetcher.close()
        ok = result.statuses == [FetchStatus.OK] * num_pages and not bad
        print(f"ok {num_pages}" if ok else f"failed {result.error} {result.statuses[:3]} bad={bad[:5]}", flush=True)
        for s in slots:
            s.release()
    finally:
        arena.close()
        arena.unlink()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]))
