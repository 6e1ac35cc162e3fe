"""The draining set of placement/watermarks.py on its own: a part drains from past the high
watermark down to the low one, across calls (a round that backs off or finds its pages
pinned resumes on a later tick even though the part is now below the high watermark), and
a part between the two that never passed the high one is never chosen."""

from __future__ import annotations

from kvstore.server.placement.watermarks import Watermarks


class _Part:
    def __init__(self, fill: float) -> None:
        self.fill = fill


def _next(marks: Watermarks, *parts: _Part) -> _Part | None:
    return marks.next_part(list(parts), lambda part: part.fill)  # type: ignore[arg-type, attr-defined, return-value]


def test_a_part_drains_from_past_its_high_watermark_to_its_low_one_and_no_further() -> None:
    marks, part = Watermarks(0.8, 0.1), _Part(0.5)
    assert _next(marks, part) is None, "below the high watermark, never past it: not draining"
    part.fill = 0.85
    assert _next(marks, part) is part
    part.fill = 0.5  # a round wrote some down, then backed off: the drain goes on
    assert _next(marks, part) is part
    part.fill = 0.1
    assert _next(marks, part) is None, "down to the low watermark: the drain ends"
    part.fill = 0.5
    assert _next(marks, part) is None, "refilled between the watermarks: no new drain"


def test_only_draining_parts_are_chosen_the_fullest_first() -> None:
    marks = Watermarks(0.8, 0.1)
    quiet, busy, other = _Part(0.7), _Part(0.9), _Part(0.85)
    assert _next(marks, quiet, busy, other) is busy
    busy.fill = 0.05
    assert _next(marks, quiet, busy, other) is other
    other.fill = 0.3
    assert _next(marks, quiet, busy, other) is other, "fuller than it, but never past the high watermark: quiet is left alone"
    other.fill = 0.1
    assert _next(marks, quiet, busy, other) is None
