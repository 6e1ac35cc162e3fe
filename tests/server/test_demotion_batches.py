"""The demoter writes its backlog down in batches (one sync and one index commit for many
pages): every page of a batch is findable on SSD only once the whole batch is durable, a
page damaged in RAM is quarantined and never demoted, and the rest of its batch is not
lost: it stays in RAM and goes down in a later round. The same after an I/O error: the
pages the round did not write stay in RAM (the demoter backs off) and go down later."""

from __future__ import annotations

import dataclasses
import hashlib
import threading

from support.servers import make_config

from kvstore.page import LayoutDesc, PageHeader, checksum
from kvstore.server.placement import Placement
from kvstore.server.placement.background import BEHIND_WRITE_BYTES, run_behind
from kvstore.server.placement.moves import DEMOTE_PAGES
from kvstore.tiers.base import Tier, TierWrapper
from kvstore.tiers.faulty import FaultyTier
from kvstore.tiers.ssd import DATA_FILE, SsdTier

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages: 128 of them fill a 4 MiB host tier
NS = b"batch-namespace!"


def _payload(key: bytes, layout: LayoutDesc = LAYOUT) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (layout.page_bytes // 64)


def _put(core: Placement, keys: list[bytes], damaged: frozenset[bytes] = frozenset(), layout: LayoutDesc = LAYOUT) -> None:
    """Stores ``keys``; those in ``damaged`` with a checksum that does not match their bytes
    (as a page whose RAM copy was damaged after it was written)."""
    alloc, slots = core.allocate(NS, layout, keys)
    for key, _ in slots:
        core.slot_view(alloc, key)[:] = _payload(key, layout)
    sums = [checksum(_payload(k, layout)) ^ (1 if k in damaged else 0) for k in keys]
    assert core.commit(alloc, keys, sums) == len(keys)


def _read(core: Placement, key: bytes) -> bytes | None:
    lease, pages = core.acquire(NS, [key], 0)
    try:
        return bytes(core.read_view(pages[0])) if pages else None
    finally:
        core.release(lease)


def test_a_damaged_page_in_a_demotion_batch_is_quarantined_and_the_rest_go_down_later(tmp_path) -> None:
    config = make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.05, demote_to=0.05))
    core = Placement(config)
    try:
        keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(100)]
        bad = keys[-4]  # among the coldest (one chain: its tail goes first): in the first batch
        _put(core, keys, frozenset([bad]))
        rounds = 0
        while core.demote_one():
            rounds += 1
        assert 1 < rounds < len(keys) // 2, f"{rounds} rounds for {len(keys)} pages: not demoted in batches"
        assert rounds >= len(keys) // DEMOTE_PAGES
        assert "ssd" not in core.where(bad) and not core.where(bad), "a damaged page was demoted or kept"
        assert [q.key for q in core.quarantined()] == [bad]
        kept = [k for k in keys if k != bad]
        on_ssd = [k for k in kept if "ssd" in core.where(k)]
        assert len(on_ssd) >= len(kept) - int(0.05 * 128), "pages of the damaged page's batch were lost or left in RAM"
        for key in kept:  # none lost, none with other bytes, wherever it is now
            assert _read(core, key) == _payload(key), key.hex()
        view = core.view()
        assert view.idle and not view.moving, view
    finally:
        core.close()


def test_an_io_error_in_a_demotion_round_keeps_its_pages_in_ram_for_a_later_round(tmp_path) -> None:
    config = make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.05, demote_to=0.05))
    made: list[FaultyTier] = []

    def wrap(tier: Tier) -> Tier:
        if tier.name == "ssd":
            made.append(FaultyTier(tier, seed=1, error_rate=1.0))  # every write fails
            return made[-1]
        return tier

    core = Placement(config, wrap=wrap)
    now = [1000.0]
    core.moves.clock = lambda: now[0]
    try:
        keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(100)]
        _put(core, keys)
        assert core.demote_one() is True  # the round ran and failed
        assert made[0].injected["error"] >= 1
        lost = [k for k in keys if not core.where(k)]
        assert not lost, f"{len(lost)} of {len(keys)} pages lost to one failed demotion round"
        assert core.demote_one() is False, "no backoff: the next round hammers the failing tier at once"
        made[0].error_rate = 0.0  # the device recovers
        now[0] += 3600
        while core.demote_one():
            pass
        on_ssd = [k for k in keys if "ssd" in core.where(k)]
        assert len(on_ssd) >= len(keys) - int(0.05 * 128), f"only {len(on_ssd)} pages went down after the backoff"
        for key in keys:
            assert _read(core, key) == _payload(key), key.hex()
        view = core.view()
        assert view.idle and not view.moving, view
    finally:
        core.close()


class _CutShort(TierWrapper):
    """Writes the first ``at`` pages of a batch, then fails: an I/O error in the middle of one
    (None: writes everything)."""

    def __init__(self, inner: Tier, at: int | None) -> None:
        super().__init__(inner)
        self.at = at
        self.cuts = 0

    def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
        if self.at is None:
            self.inner.write(pages)
            return
        self.inner.write(pages[: self.at])
        self.cuts += 1
        raise OSError("injected: the device failed in the middle of a batch")


def test_a_demotion_batch_cut_short_by_an_io_error_leaves_no_page_findable_that_is_not_on_disk(tmp_path) -> None:
    """The round's pages are written in one call to the device (write): when it fails
    after some of them reached the disk, none is indexed nor published, all stay in RAM, and
    a restart finds none; once the device works they go down, and a restart finds exactly
    the pages the directory listed on SSD."""
    config = make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.05, demote_to=0.05))
    made: list[_CutShort] = []

    def wrap(tier: Tier) -> Tier:
        if tier.name == "ssd":
            made.append(_CutShort(tier, at=3))
            return made[-1]
        return tier

    keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(100)]
    core = Placement(config, wrap=wrap)
    now = [1000.0]
    core.moves.clock = lambda: now[0]
    try:
        _put(core, keys)
        assert core.demote_one() is True and made[0].cuts == 1
        assert not [k for k in keys if "ssd" in core.where(k)], "a page of a failed batch was published on SSD"
        assert not [k for k in keys if not core.where(k)], "a page of a failed batch was lost"
        assert (tmp_path / "ssd" / DATA_FILE).stat().st_size > 0, "the cut batch wrote nothing: the test tests nothing"
    finally:
        core.close()
    ssd = SsdTier(config.ssd)  # type: ignore[arg-type]
    try:
        assert ssd.recover() == [], "a restart found a page its batch never committed"
    finally:
        ssd.close()
    core = Placement(config, wrap=wrap)
    try:
        _put(core, keys)
        made[-1].at = None  # the device works
        while core.demote_one():
            pass
        on_ssd = {k for k in keys if "ssd" in core.where(k)}
        assert len(on_ssd) > len(keys) // 2
        for key in keys:
            assert _read(core, key) == _payload(key), key.hex()
    finally:
        core.close()
    ssd = SsdTier(config.ssd)  # type: ignore[arg-type]
    try:
        assert {key for key, _, _, _ in ssd.recover()} == on_ssd
    finally:
        ssd.close()


def test_the_background_demoter_hands_the_disk_its_round_in_pieces(tmp_path) -> None:
    """A demotion round in the idle class reaches the SSD tier in pieces of whole pages of at
    most BEHIND_WRITE_BYTES, each a pwritev: the kernel pins an O_DIRECT write's pages without a
    preemption point, and on the development VM's kernel (PREEMPT_NONE) a round written whole (32 MiB) held a CPU
    ~1 ms that a lookup woken meanwhile waited for. A foreground round (an allocation waiting on
    it) still goes in one call; every page of both reads back as written."""
    layout = LayoutDesc(8, 2, 2, 64, "float16", 128)  # 512 KiB pages: 4 to a piece, 32 fill the host tier
    config = make_config(tmp_path, host_bytes=16 << 20, ssd_bytes=64 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.05, demote_to=0.05))
    writes: list[list[int]] = []

    class Recording(TierWrapper):
        def write(self, pages: list[tuple[int, PageHeader, memoryview]]) -> None:
            writes.append([header.payload_bytes for _, header, _ in pages])
            self.inner.write(pages)

    core = Placement(config, wrap=lambda tier: Recording(tier) if tier.name == "ssd" else tier)
    try:
        keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(40)]
        _put(core, keys[:20], layout=layout)

        def behind_round() -> None:
            run_behind("idle", 0)
            assert core.demote_one()

        thread = threading.Thread(target=behind_round)
        thread.start()
        thread.join(30)
        assert len(writes) > 1, f"a background round of {len(keys) // 2} pages went down in {len(writes)} call(s)"
        assert all(sum(w) <= BEHIND_WRITE_BYTES for w in writes), writes
        assert sum(map(len, writes)) >= 16, writes
        writes.clear()
        _put(core, keys[20:], layout=layout)
        assert core.demote_one()  # this thread: the foreground
        assert len(writes) == 1 and len(writes[0]) >= 16, writes
        for key in keys:
            assert _read(core, key) == _payload(key, layout), key.hex()
    finally:
        core.close()
