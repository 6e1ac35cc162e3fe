"""A demoter round's write fails (its pages stay in RAM, unpinned) while an allocation's own
eviction is still being written down: the next victim is the chain's tail again (the round's
pages, no longer moving), not the page before the allocation's victim.

Bug pinned: TailFirst's round shortcut (``_picked``: the page before a victim being moved is
that chain's end next) trusted that every page after its victim was still being moved. A move
that ends tells the order nothing, so once the round's pages were back the shortcut named the
page before the allocation's victim: the put lost a page from its findable prefix, and with a
caller's pin after the moving page it named a page that pin keeps (DESIGN §6: victim held to
priorities; a pinned page keeps the pages before it)."""

from __future__ import annotations

import errno
import threading

from support.core_pages import CorePages, in_host, page_keys
from support.servers import make_config

from kvstore.config import HostTierConfig
from kvstore.server.leases import Pins
from kvstore.server.placement import Placement
from kvstore.server.placement.eviction import HostResidency
from kvstore.server.placement.orders import HostOrder, TailFirstOrder

NS = b"round-failed-ev!"
PAGES = CorePages(NS)


def _moving(pins: Pins, keys: list[bytes], moving: bool = True) -> None:
    if moving:
        pins.update(keys)
        pins.pin_moves(keys)
    else:  # as LeaseTable.unpin: a key with no pin left is not in the pins
        pins.unpin_moves(keys)
        pins.subtract(keys)
        for key in keys:
            if pins[key] <= 0:
                del pins[key]


def test_the_order_names_the_tail_once_a_round_is_back() -> None:
    """a→b→c→d: a round names d (moving), an eviction beside it names c (moving); the round's
    write fails (d unpinned, still held): the next victim is d, as the priorities say, not b. With
    d pinned by a caller, nothing of the chain may go (a pinned page keeps the pages before it)."""
    for make in (lambda: HostOrder(HostTierConfig(capacity_bytes=64 << 20)), TailFirstOrder):
        for caller_pin in (False, True):
            order = make()
            a, b, c, d = page_keys("abcd", 4)
            for key, parent in ((a, None), (b, a), (c, b), (d, c)):
                order.stored(key, parent)
            pins = Pins()
            assert order.victim(pins, 1) == d
            _moving(pins, [d])  # the round's page, its write in flight
            assert order.victim(pins, 1) == c
            _moving(pins, [c])  # the allocation's victim, its write in flight
            _moving(pins, [d], moving=False)  # the round's write failed: d stays, unpinned
            if caller_pin:
                pins.update([d])
            ranked = order.priorities(pins, 1)
            named = order.victim(pins, 1)
            want = None if caller_pin else d
            assert named == want, f"{type(order).__name__}: named {named!r}, priorities {ranked}"
            assert (min(ranked, key=ranked.__getitem__) if ranked else None) == want


def test_a_page_used_as_announced_after_a_rounds_victim_is_the_tail_again() -> None:
    """a→b→c→d, d hinted (a queued request reads it: not walked): a round names c, then b by
    its shortcut; d used as announced (followed again, unpinned, after c being moved) is the
    chain's tail: the round's next victim is d, not a."""
    order = HostResidency(segmented=False)
    a, b, c, d = page_keys("used", 4)
    for key, parent in ((a, None), (b, a), (c, b), (d, c)):
        order.add(key, parent)
    order.hint(d, 1.0, depth=3)
    pins = Pins()
    assert order.victim(pins) == c
    _moving(pins, [c])
    assert order.victim(pins) == b
    _moving(pins, [b])
    order.consume(d, 1.0)  # used: no announced use left
    ranked = order.priorities(pins)
    assert order.victim(pins) == d == min(ranked, key=ranked.__getitem__)


def test_a_failed_round_beside_an_allocations_write_leaves_the_chain_its_pages(tmp_path) -> None:
    """Every write-down fails (a failing device). RAM full of one put's chain; a round names its
    tail pages and its write is held; an allocation's eviction names the page before them and its
    write is held; the round's write fails (its pages stay, unpinned); another allocation then
    takes the chain's tail, and the chain keeps every page before the held allocation's victim."""
    core = Placement(make_config(tmp_path, host_bytes=4 << 20))  # 128 pages
    go = {name: threading.Event() for name in ("round", "alloc")}
    entered = {name: threading.Event() for name in go}
    try:
        put = page_keys("put", 128)
        parent = None
        for start in range(0, len(put), 8):
            assert PAGES.put(core, put[start:start + 8], parent=parent) == 8
            parent = put[start + 7]
        assert all(in_host(core, put))

        def failing_device(*args, **kwargs):  # held for the named threads, then an I/O error
            name = threading.current_thread().name
            if name in go:
                entered[name].set()
                assert go[name].wait(60)
            raise OSError(errno.EIO, "injected: the device fails")

        core.moves.write_down = failing_device  # type: ignore[method-assign]
        round_thread = threading.Thread(target=core.demote_one, name="round")
        round_thread.start()
        assert entered["round"].wait(60), "the round wrote nothing down"
        named = [k for k in put if core.leases.moving(k)]
        assert named == put[-len(named):], "the round named the chain's tail"
        before = put[-len(named) - 1]  # the allocation's victim: the page before the round's
        other = page_keys("other", 2)
        alloc_thread = threading.Thread(target=PAGES.allocate, args=(core, other[:1]), name="alloc")
        alloc_thread.start()
        assert entered["alloc"].wait(60), "the allocation evicted nothing"
        assert core.leases.moving(before)
        go["round"].set()
        round_thread.join(60)
        assert all(in_host(core, named)) and not any(core.leases.moving(k) for k in named)
        PAGES.allocate(core, other[1:])  # takes one page: the chain's tail, the round's last named
        assert in_host(core, put) == [True] * (len(put) - 1) + [False], \
            f"took page {in_host(core, put).index(False)} of {len(put)}, not the tail"
        go["alloc"].set()
        alloc_thread.join(60)
        assert not alloc_thread.is_alive()
        head = in_host(core, put).index(False)
        assert head == len(put) - len(named) - 1, head  # all but the held allocation's victim and after
    finally:
        for event in go.values():
            event.set()
        core.close()
