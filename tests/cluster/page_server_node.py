"""A UCX page server as a child process (for kill and stop tests). Serves synthetic pages:
page(key) = a fixed random block with the key in its first 16 bytes; keys starting 0xFF are
missing, keys starting 0xEE are served with a wrong stored checksum (corruption at rest).
A request whose first key starts 0xDD (0xDC) makes the process SIGKILL (SIGSTOP) itself
5 ms after it starts answering: a sender dying (freezing) mid-transfer, deterministically.
Prints its port, then ``open <n>`` each time it opens n pages for a request.

    python tests/cluster/page_server_node.py PAGE_BYTES TLS PROGRESS_MODE [PLANE]

PLANE ``tcp``: the TCP page server (transport_tcp) instead, on 127.0.0.1 (TLS and the mode
unused); it prints ``damaged <key hex>`` when it finds a page's bytes do not match.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.cluster.page_fetch import SourcePage
from kvstore.page import checksum

_BASE: dict[int, np.ndarray] = {}


def expected_page(key: bytes, page_bytes: int) -> np.ndarray:
    if page_bytes not in _BASE:
        _BASE[page_bytes] = np.random.default_rng(1234).integers(0, 256, page_bytes, dtype=np.uint8)
    page = _BASE[page_bytes].copy()
    page[:16] = np.frombuffer(key, dtype=np.uint8)
    return page


class SyntheticSource:
    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes

    async def open_pages(self, namespace_id: bytes, keys: Sequence[bytes], generation: int = 0) -> list[SourcePage | None]:
        print(f"open {len(keys)}", flush=True)
        pages: list[SourcePage | None] = []
        for key in keys:
            if key[0] == 0xFF:
                pages.append(None)
                continue
            data = expected_page(key, self.page_bytes)
            pages.append(SourcePage(data, checksum(data) + (1 if key[0] == 0xEE else 0),
                                    damaged=lambda reason, key=key: print(f"damaged {key.hex()}", flush=True)))
        if keys[0][0] in (0xDD, 0xDC):  # once the pages are ready: the answer starts now
            sig = signal.SIGKILL if keys[0][0] == 0xDD else signal.SIGSTOP
            # a thread, not the event loop: the loop is busy sending when the moment comes
            threading.Timer(0.005, os.kill, (os.getpid(), sig)).start()
        return pages


async def main(page_bytes: int, tls: str, progress_mode: str, plane: str) -> None:
    server: Any
    if plane == "tcp":
        from kvstore.cluster.transport_tcp import TcpPageServer

        server = TcpPageServer(SyntheticSource(page_bytes))
    else:
        from kvstore.cluster.transport_ucx import UcxConfig, UcxPageServer

        server = UcxPageServer(SyntheticSource(page_bytes), UcxConfig(tls=tls, progress_mode=progress_mode))
    port = await server.start()
    print(port, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "ucx"))
