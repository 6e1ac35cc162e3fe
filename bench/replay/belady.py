"""The offline optimum for a cache of fixed size (Belady/MIN): on a miss, keep the blocks
whose next use is soonest; a block whose next use is later than every cached one is not
admitted at all. The reference the replay's online policies are measured against."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

INF = float("inf")


def next_uses(seq: Sequence[int]) -> list[float]:
    nxt: list[float] = [INF] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], INF)
        last[seq[i]] = i
    return nxt


def belady_hits(seq: Sequence[int], capacity: int) -> int:
    """Hits of the optimal policy over an access sequence."""
    if capacity <= 0:
        return 0
    nxt = next_uses(seq)
    cached: dict[int, float] = {}           # block -> its next use
    heap: list[tuple[float, int]] = []      # (-next use, block), lazily invalidated
    hits = 0
    for i, block in enumerate(seq):
        if block in cached:
            hits += 1
        elif len(cached) >= capacity:
            while heap and cached.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if not heap or -heap[0][0] <= nxt[i]:
                continue  # every cached block is needed sooner: bypass
            _, victim = heapq.heappop(heap)
            del cached[victim]
        cached[block] = nxt[i]
        heapq.heappush(heap, (-nxt[i], block))
    return hits
