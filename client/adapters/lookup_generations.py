"""The namespace generation an engine's lookup of each page key answered, kept for its write of
that key (DESIGN §3): an adapter whose calls carry no request (SGLang's HiCache backend, the
``transformers`` helper) names it to the put, so KV computed on a lookup made before an
acknowledged invalidation is refused rather than stored in the new generation.

More: client/adapters/README.md (### lookup_generations.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_KEYS = 1 << 16  # ~10 MiB at most; an engine writes a key back seconds after looking it up


class LookupGenerations:
    """Page key -> the lowest generation a lookup of it answered since its last write.

    ``remember`` after a lookup, ``take`` at the write. A later lookup never raises a key's
    generation: KV computed on the earlier one may still be written. A write keeps the key at the
    generation it named until its next lookup: a retry of a refused write, or another write of KV
    computed on the same lookups, names it again (DESIGN §3). Bounded: past ``capacity`` keys the
    least recently used are forgotten (their writes name what the adapter names for a key never
    looked up). Thread-safe."""

    def __init__(self, capacity: int = MAX_KEYS) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._generations: OrderedDict[bytes, int] = OrderedDict()  # g: looked up; ~g (< 0): written since

    def __len__(self) -> int:
        return len(self._generations)

    def remember(self, keys: list[bytes], generation: int) -> None:
        """A lookup of ``keys`` answered ``generation``."""
        with self._lock:
            for key in keys:
                known = self._generations.pop(key, None)
                self._generations[key] = generation if known is None or known < 0 else min(known, generation)
            while len(self._generations) > self.capacity:
                self._generations.popitem(last=False)

    def take(self, keys: list[bytes]) -> list[int | None]:
        """Each key's generation (None: not remembered), kept as written until its next lookup."""
        with self._lock:
            out: list[int | None] = []
            for key in keys:
                known = self._generations.get(key)
                if known is not None:
                    self._generations[key] = known if known < 0 else ~known
                    self._generations.move_to_end(key)
                out.append(None if known is None else known if known >= 0 else ~known)
            return out

    def clear(self) -> None:
        with self._lock:
            self._generations.clear()
