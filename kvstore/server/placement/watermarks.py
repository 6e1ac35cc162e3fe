"""Which parts of the landing tier are draining: the demoter's two watermarks, per arena.

More: kvstore/server/placement/README.md (### watermarks.py).
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.tiers.base import LandingPart


class Watermarks:
    def __init__(self, high: float, low: float) -> None:
        self.high, self.low = high, low
        self._draining: set[int] = set()  # id() of the parts draining (parts live as long as the tier)

    def next_part(self, parts: list[LandingPart], fill: Callable[[LandingPart], float]) -> LandingPart | None:
        """The fullest part that is draining now (None: none is), after starting the parts
        past the high watermark and ending those down to the low one."""
        fullest, most = None, -1.0
        for part in parts:
            level = fill(part)
            if level > self.high:
                self._draining.add(id(part))
            elif level <= self.low:
                self._draining.discard(id(part))
            if id(part) in self._draining and level > most:
                fullest, most = part, level
        return fullest
