"""``RemoteTier.local_prefix`` sees a commit's pages all at once or not at all.

Bug pinned here: it read the directory without its lock while a commit published its pages one by
one, so a handoff push kicked by a STORED event (DESIGN §12.7) could name the first pages of a
commit and not the rest. At the decode node a Push that names part of a layer-wise landing's
allocation ends that allocation: the layers that had gone ahead for the other pages were given back
and those pages fetched whole (``test_handoff_layers[ucx]`` saw 2 of 6 pages committed in place).

A real server's core commits allocations of 64 pages on one thread while another reads the prefix,
the interpreter switching threads every microsecond."""

from __future__ import annotations

import asyncio
import secrets
import sys
import threading
from typing import Any

from kvstore.page import LayoutDesc
from kvstore.server.cluster.remote import RemoteTier

LAYOUT = LayoutDesc(num_layers=2, kv_factor=2, num_kv_heads=2, head_dim=64, dtype="float16", page_tokens=16)
PAGES = 64
ROUNDS = 20


async def test_a_commit_is_seen_whole(server: Any) -> None:
    core = server.core
    tier = RemoteTier(core, {}, None, "tcp")  # type: ignore[arg-type]  # local_prefix reads only this node's directory
    ns = secrets.token_bytes(16)
    rounds = [[secrets.token_bytes(16) for _ in range(PAGES)] for _ in range(ROUNDS)]
    seen: set[int] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            for keys in rounds:
                seen.add(tier.local_prefix(ns, keys))

    reader = threading.Thread(target=read)
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        reader.start()
        await asyncio.to_thread(_commit_each, core, ns, rounds)
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(before)
    assert seen <= {0, PAGES}, f"a commit seen in part: prefixes {sorted(seen - {0, PAGES})}"


def _commit_each(core: Any, ns: bytes, rounds: list[list[bytes]]) -> None:
    for keys in rounds:
        allocation, slots = core.allocate(ns, LAYOUT, keys)
        assert all(slot is not None for _, slot in slots)
        assert core.commit(allocation, keys, [0] * len(keys)) == PAGES
