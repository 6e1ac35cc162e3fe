"""Which parts of the landing tier are draining: the demoter's two watermarks, per arena.

A part (a tenant's arena, or the whole host tier without tenants) starts draining once it
fills past ``demote_above`` and goes on, across demotion rounds and idle ticks, until it is
down to ``demote_to``. Below its high watermark a part that is not draining keeps its pages
in RAM however long the demoter idles: a page written down early costs SSD endurance for
nothing (it may be deleted before RAM is needed). The state is per part because each
tenant's arena fills on its own: one tenant's arena passing its watermark is no reason to
write another tenant's pages down.

Thread-safety: the caller holds the placement core's lock.
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
