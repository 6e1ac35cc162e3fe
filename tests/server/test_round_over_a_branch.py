"""A demoter round names both branches after a shared prefix (two puts with one head), and a put
commits after its branch's named pages while the round is in flight: the walk goes down the
branch that leads to what the put committed, not down the other, whose pages are all being
moved, so the next allocation takes the put's own tail, not the shared prefix.

Bug pinned: at a page whose next pages were all being moved down, the walk followed any of
them (set order: one run in two); down the branch of moving pages alone, the deepest page not
being moved was the shared prefix's last, and the allocation took the prefix from there back
(with a failing lower tier, lost: the put kept none of its pages past that point). DESIGN §6:
a page being moved is walked through, what a put committed after it is the chain's tail."""

from __future__ import annotations

import errno
import threading
from collections import Counter

from support.core_pages import CorePages, in_host, page_keys
from support.servers import make_config

from kvstore.config import HostTierConfig
from kvstore.server.leases import Pins, PinsAnd
from kvstore.server.placement import Placement
from kvstore.server.placement.orders import HostOrder, TailFirstOrder

NS = b"round-branches!!"
PAGES = CorePages(NS)


def test_the_walk_takes_the_branch_that_leads_past_the_moving_pages() -> None:
    """s→{a, b}, a and b being moved, c after b: c goes (it is the chain's tail), never s; with c
    leaned on (kept), the host order takes it in the leaning chains' turn, the SSD order nothing.
    Sixteen key sets: a walk that picks a branch at random picks the dead one in some."""
    for n in range(16):
        s, a, b, c = page_keys(f"branch{n}", 4)
        for make in (lambda: HostOrder(HostTierConfig(capacity_bytes=64 << 20)), TailFirstOrder):
            for leaned in (False, True):
                order = make()
                for key, parent in ((s, None), (a, s), (b, s), (c, b)):
                    order.stored(key, parent)
                pins = Pins()
                pins.update([a, b])
                pins.pin_moves([a, b])
                kept = PinsAnd(pins, Counter([c])) if leaned else pins
                named = order.victim(kept, 1)
                ranked = order.priorities(kept, 1)
                want = None if leaned and isinstance(order, TailFirstOrder) else c  # the SSD order leans on nothing
                assert named == want, f"{type(order).__name__} set {n} leaned {leaned}: named {named!r}, priorities {ranked}"
                assert (min(ranked, key=ranked.__getitem__) if ranked else None) == want


def _scenario(tmp_path, n: int) -> tuple[int, int]:
    """How many leading pages of the put's chain (the shared prefix, its branch, the batch it
    committed while the round was in flight) are found after the next batch's allocation, and
    how many the prefix and its branch hold."""
    core = Placement(make_config(tmp_path / str(n), host_bytes=4 << 20))  # 128 pages
    go, entered = threading.Event(), threading.Event()
    try:
        shared, other, branch = page_keys(f"shared{n}", 112), page_keys(f"other{n}", 4), page_keys(f"branch{n}", 4)
        parent = None
        for start in range(0, len(shared), 8):
            assert PAGES.put(core, shared[start:start + 8], parent=parent) == 8
            parent = shared[start + 7]
        assert PAGES.put(core, other, parent=shared[-1]) == 4  # the other request's pages after the prefix
        assert PAGES.put(core, branch, parent=shared[-1]) == 4  # the put's first batch after it
        batch = page_keys(f"batch{n}", 8)
        alloc = PAGES.allocate(core, batch, parent=branch[-1])  # its next batch, open: RAM is full

        def failing_device(*args, **kwargs):  # the round's write held, then every write-down fails
            if threading.current_thread().name == "round":
                entered.set()
                assert go.wait(60)
            raise OSError(errno.EIO, "injected: the device fails")

        core.moves.write_down = failing_device  # type: ignore[method-assign]
        round_thread = threading.Thread(target=core.demote_one, name="round")
        round_thread.start()
        assert entered.wait(60), "the round wrote nothing down"
        assert all(core.leases.moving(k) for k in other + branch), "the round named both branches"
        PAGES.commit(core, alloc, batch)  # committed after the round's pages: the chain's tail now
        PAGES.allocate(core, page_keys(f"next{n}", 8), parent=batch[-1])  # takes 8 pages
        found = in_host(core, shared + branch + batch).index(False)
        go.set()
        round_thread.join(60)
        assert not round_thread.is_alive()
        return found, len(shared) + len(branch)
    finally:
        go.set()
        core.close()


def test_a_round_over_both_branches_leaves_the_put_its_prefix(tmp_path) -> None:
    for n in range(8):  # the branch a walk follows first is the set order's: eight key sets
        found, kept = _scenario(tmp_path, n)
        assert found >= kept, f"key set {n}: the put keeps {found} leading pages, the prefix and its branch are {kept}"
