"""A count of the chain steps an eviction order's victim search takes (each lookup of the pages
after a page), for the tests that hold a search to so many steps a page."""

from __future__ import annotations

from collections.abc import Callable, Collection

from kvstore.server.placement.chains import PrefixLinks


def count_steps(links: PrefixLinks) -> Callable[[], int]:
    """Counts every ``links.after`` from now on; returns the count so far when called."""
    steps = 0
    after = links.after

    def counted(key: bytes) -> Collection[bytes]:  # the real lookup, counted
        nonlocal steps
        steps += 1
        return after(key)

    links.after = counted  # type: ignore[method-assign]
    return lambda: steps
