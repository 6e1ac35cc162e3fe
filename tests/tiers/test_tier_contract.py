"""The Tier contract (tiers/base.py), run against every tier and against fault-injecting
wrappers of them: a new tier is tested by adding one line to CASES.

Against a faulty tier an operation may fail (OSError, a short read, a page found corrupt),
but never in a way the contract forbids: a page counted as read has exactly the bytes that
were written, a failed write or commit stores nothing, a miss is a value.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.config import HbmTierConfig, HostTierConfig, SsdTierConfig
from kvstore.page import HEADER_BYTES, LayoutDesc, PageHeader, checksum
from kvstore.tiers.base import Tier
from kvstore.tiers.faulty import FaultyTier
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.pools import OwnerPools
from kvstore.tiers.slab import round_up
from kvstore.tiers.ssd import DATA_FILE, SsdTier

PAGE = LayoutDesc(2, 2, 2, 64, "float16", 16)  # 16 KiB pages
NS = b"contract-ns-0000"


def _host(tmp: Path) -> Tier:
    return HostTier(HostTierConfig(capacity_bytes=4 << 20, slab_bytes=1 << 20), node=f"contract{os.getpid()}")


def _ssd(direct_io: bool) -> Callable[[Path], Tier]:
    def make(tmp: Path) -> Tier:
        return SsdTier(SsdTierConfig(directory=tmp / "ssd", capacity_bytes=4 << 20, slab_bytes=1 << 20, direct_io=direct_io, dwpd=0))
    return make


def _hbm(tmp: Path) -> Tier:
    return HbmTier(HbmTierConfig(capacity_bytes=4 << 20, slab_bytes=1 << 20, device="cpu"))  # the test-only emulation


def _pools(tmp: Path) -> Tier:  # the one pool of a map of pools without tenants, as the map makes it
    return OwnerPools(HbmTierConfig(capacity_bytes=4 << 20, slab_bytes=1 << 20, device="cpu"), per_owner=False).part("")


def _slot(tier: Tier, key: bytes) -> int:
    found = tier.find(key)
    assert found is not None
    return found[0]


def _damage_pools(tier: Tier, tmp: Path, key: bytes) -> None:
    slot = _slot(tier, key)
    tier.device_view(slot + 7, 1)[0] ^= 0xFF  # type: ignore[attr-defined]  # the pool an engine maps


def _damage_host(tier: Tier, tmp: Path, key: bytes) -> None:
    slot = _slot(tier, key)
    view = tier.view(slot + 7, 1)  # type: ignore[attr-defined]  # the arena a client maps
    view[0] ^= 0xFF


def _damage_hbm(tier: Tier, tmp: Path, key: bytes) -> None:
    slot = _slot(tier, key)
    pool = tier.pool  # type: ignore[attr-defined]  # the device memory (here: emulated in host memory)
    pool[slot + 7] ^= 0xFF


def _damage_ssd(tier: Tier, tmp: Path, key: bytes) -> None:
    slot = _slot(tier, key)
    fd = os.open(tmp / "ssd" / DATA_FILE, os.O_RDWR)
    try:
        at = slot + HEADER_BYTES + 7
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], Tier]
    damage: Callable[[Tier, Path, bytes], None]
    recovers: bool  # its index outlives the process (a durable tier)
    faults: dict[str, float] | None = None  # FaultyTier(inner, seed, **faults) around it

    def open(self, tmp: Path, seed: int = 0) -> Tier:
        tier = self.make(tmp)
        return tier if self.faults is None else FaultyTier(tier, seed, **self.faults)


CASES = {
    "host": Case(_host, _damage_host, recovers=False),
    "hbm-emulated": Case(_hbm, _damage_hbm, recovers=False),
    "hbm-pools-emulated": Case(_pools, _damage_pools, recovers=False),
    "ssd-direct": Case(_ssd(True), _damage_ssd, recovers=True),
    "ssd-buffered": Case(_ssd(False), _damage_ssd, recovers=True),
    "faulty-host": Case(_host, _damage_host, recovers=False, faults={"error_rate": 0.2, "short_read_rate": 0.2, "corrupt_rate": 0.2}),
    "faulty-hbm-emulated": Case(_hbm, _damage_hbm, recovers=False,
                                faults={"error_rate": 0.2, "short_read_rate": 0.2, "corrupt_rate": 0.2}),
    "faulty-ssd": Case(_ssd(True), _damage_ssd, recovers=True,
                       faults={"error_rate": 0.2, "short_read_rate": 0.2, "corrupt_rate": 0.2, "delay_s": 0.001}),
}


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture
def tier(case: Case, tmp_path: Path):  # yields a Tier
    t = case.open(tmp_path)
    yield t
    t.close()


def _page(i: int) -> tuple[PageHeader, bytes]:
    payload = bytes([(i * 7 + j) % 251 for j in range(256)]) * (PAGE.page_bytes // 256)
    key = i.to_bytes(16, "big")
    return PageHeader(NS, key, PAGE, PAGE.page_bytes, checksum(payload), generation=i), payload  # recover() says it


def _buffer() -> memoryview:
    return memoryview(bytearray(round_up(PAGE.page_bytes) + 4096))


def _store(tier: Tier, faulty: bool, pages: list[int]) -> list[int]:
    """Stores pages (one batch each); under faults a failed batch stores nothing and is
    tried again. Returns the pages stored."""
    stored = []
    for i in pages:
        header, payload = _page(i)
        for _ in range(20):
            slot = tier.reserve(header.payload_bytes)
            assert slot is not None, "the tier is full"
            try:
                tier.write([(slot, header, memoryview(payload))])
                tier.commit([(slot, header)])
            except OSError:
                assert faulty, "a fault-free tier failed a write"
                tier.unreserve(slot)
                assert not tier.contains(header.key), "a failed write or commit stored the page"
                continue
            stored.append(i)
            break
    return stored


def _read(tier: Tier, pages: list[int]) -> tuple[int, str, list[memoryview]]:
    bufs = [_buffer() for _ in pages]
    try:
        result = tier.read_into([(_page(i)[0].key, buf) for i, buf in zip(pages, bufs)])
    except OSError:
        return 0, "", bufs
    for i, buf in zip(pages[: result.num_read], bufs):
        assert bytes(buf[: PAGE.page_bytes]) == _page(i)[1], "a page counted as read has other bytes than were written"
    return result.num_read, result.reason, bufs


def test_a_miss_is_a_value(tier: Tier) -> None:
    key = b"m" * 16
    assert not tier.contains(key) and tier.find(key) is None and key not in tier.stored_keys()
    try:
        assert tier.delete([key]) == 0
    except OSError:
        assert isinstance(tier, FaultyTier)
    try:
        assert tier.read_into([(key, _buffer())]).num_read == 0
    except OSError:
        assert isinstance(tier, FaultyTier)


def test_a_committed_page_reads_back_verified(tier: Tier, case: Case) -> None:
    faulty = case.faults is not None
    stored = _store(tier, faulty, [1, 2, 3])
    assert stored == [1, 2, 3]
    slots = set()
    for i in stored:
        found = tier.find(_page(i)[0].key)
        assert tier.contains(_page(i)[0].key) and found is not None and found[1] == _page(i)[0]
        slots.add(found[0])
    assert len(slots) == 3, "each page in a slot of its own"
    assert sorted(tier.stored_keys()) == [_page(i)[0].key for i in stored]
    assert tier.usage().num_pages == 3
    num_read, _, _ = _read(tier, stored)
    assert faulty or num_read == 3


def test_a_written_page_is_not_found_before_its_commit(tier: Tier) -> None:
    header, payload = _page(9)
    slot = tier.reserve(header.payload_bytes)
    assert slot is not None
    try:
        tier.write([(slot, header, memoryview(payload))])
    except OSError:
        assert isinstance(tier, FaultyTier)
    assert not tier.contains(header.key)
    assert _read(tier, [9])[0] == 0
    tier.unreserve(slot)
    assert tier.usage().used_bytes == 0, "an unreserved slot is free again"


def test_only_a_contiguous_prefix_counts(tier: Tier, case: Case) -> None:
    stored = _store(tier, case.faults is not None, [1, 2, 4])
    assert stored == [1, 2, 4]
    num_read, _, _ = _read(tier, [1, 2, 3, 4])
    assert num_read <= 2, "a page after a miss counted"
    assert case.faults is not None or num_read == 2


def test_a_damaged_page_is_never_counted(tier: Tier, case: Case, tmp_path: Path) -> None:
    stored = _store(tier, case.faults is not None, [1, 2])
    case.damage(tier, tmp_path, _page(2)[0].key)
    num_read, reason, _ = _read(tier, stored)
    assert num_read <= 1
    if case.faults is None:
        assert num_read == 1 and "checksum" in reason


def test_full_is_none_and_room_comes_from_a_delete(tier: Tier, case: Case) -> None:
    stored: list[int] = []
    slot = tier.reserve(PAGE.page_bytes)
    while slot is not None:  # fills the tier (a few hundred pages)
        tier.unreserve(slot)
        stored += _store(tier, case.faults is not None, [len(stored)])
        slot = tier.reserve(PAGE.page_bytes)
    victim = _page(stored[0])[0].key  # which one is the core's eviction order's (test_eviction_replay)
    try:
        assert tier.delete([victim], evicted=True) == 1
    except OSError:
        assert case.faults is not None
        return
    assert tier.delete([victim]) == 0, "delete is idempotent"
    assert tier.reserve(PAGE.page_bytes) is not None, "deleting the victim made room"


def test_commit_of_a_held_key_replaces_it(tier: Tier, case: Case) -> None:
    assert _store(tier, case.faults is not None, [5]) == [5]
    single = tier.usage().used_bytes
    assert _store(tier, case.faults is not None, [5]) == [5]
    assert tier.usage().num_pages == 1
    assert tier.usage().used_bytes == single, "the replaced copy's slot was freed"
    assert _read(tier, [5])[0] <= 1


def test_quarantine_drops_and_lists_the_page(tier: Tier, case: Case) -> None:
    _store(tier, case.faults is not None, [3])
    tier.quarantine(_page(3)[0].key, "found damaged")
    assert not tier.contains(_page(3)[0].key)
    assert [(q.key, q.namespace_id, q.reason) for q in tier.quarantined()] == [(_page(3)[0].key, NS, "found damaged")]
    assert [q.key for q in tier.quarantined(purge=True)] == [_page(3)[0].key], "a purge answers what it dropped"
    assert tier.quarantined() == [] and tier.quarantined(purge=True) == []


@pytest.mark.parametrize("name", ["host", "hbm-emulated"])
def test_two_reports_of_one_damage_list_the_page_once(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: a report read the page's header, then listed it and dropped it; a second report of
    the same damage that had read the header before the first dropped the page listed it again
    (the quarantine counted one damaged page twice). Only the report that drops it lists it."""
    tier = CASES[name].open(tmp_path)
    try:
        _store(tier, False, [3])
        key = _page(3)[0].key
        found = tier.find(key)
        monkeypatch.setattr(tier, "find", lambda k: found)  # the second report read it before the first dropped it
        tier.quarantine(key, "found damaged")
        tier.quarantine(key, "found damaged")
        assert [q.key for q in tier.quarantined()] == [key]
    finally:
        tier.close()


def test_recover_lists_what_outlived_the_process(case: Case, tmp_path: Path) -> None:
    tier = case.open(tmp_path)
    try:
        stored = _store(tier, case.faults is not None, [1, 2, 3])
    finally:
        tier.close()
    again = case.open(tmp_path, seed=1)
    try:
        recovered = set(again.recover())
        expected = {(_page(i)[0].key, NS, PAGE.page_bytes, _page(i)[0].generation) for i in stored} if case.recovers else set()
        assert recovered == expected
        if case.recovers:
            assert _read(again, stored)[0] <= len(stored)
    finally:
        again.close()


def test_concurrent_writers_and_readers_of_distinct_pages(tier: Tier, case: Case) -> None:
    faulty = case.faults is not None
    errors: list[BaseException] = []

    def work(base: int) -> None:
        try:
            pages = _store(tier, faulty, [base + i for i in range(8)])
            for _ in range(5):
                num_read, _, _ = _read(tier, pages)
                assert faulty or num_read == len(pages)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(1000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert tier.usage().num_pages == 32


@pytest.mark.parametrize("name", ["host", "ssd-buffered"])
def test_a_commit_with_another_number_of_parents_than_pages_stores_nothing(name: str, tmp_path: Path) -> None:
    """The tiers that keep parents read them through one helper (tiers.base.parent_links): a
    list of another length is refused before anything is stored, where zipping it with the
    pages would have stored only the pages up to the shorter list's end."""
    tier = CASES[name].open(tmp_path)
    try:
        pages = [_page(i) for i in range(2)]
        slots = []
        for header, payload in pages:
            slot = tier.reserve(header.payload_bytes)
            assert slot is not None
            tier.write([(slot, header, memoryview(payload))])
            slots.append(slot)
        with pytest.raises(ValueError, match="1 parents for 2 pages"):
            tier.commit([(slot, header) for slot, (header, _) in zip(slots, pages)], [None])
        assert not any(tier.contains(header.key) for header, _ in pages)
        tier.commit([(slot, header) for slot, (header, _) in zip(slots, pages)], [None, pages[0][0].key])
        assert all(tier.contains(header.key) for header, _ in pages)
    finally:
        tier.close()


def test_a_batch_written_at_once_reads_back_and_one_cut_short_stores_nothing(tier: Tier, case: Case) -> None:
    """A ``write`` of several pages (adjacent slots, as a demotion round's): after
    the commit every page reads back verified; when it fails (a faulty tier's error cuts the
    batch at a page, after writing the ones before it) and the slots are given back, no page
    of the batch is stored."""
    faulty = case.faults is not None
    pages = [_page(i) for i in range(20, 24)]
    for _ in range(30):
        slots = [tier.reserve(header.payload_bytes) for header, _ in pages]
        assert None not in slots, "the tier is full"
        try:
            tier.write([(slot, header, memoryview(payload)) for slot, (header, payload) in zip(slots, pages)])  # type: ignore[misc]
            tier.commit([(slot, header) for slot, (header, _) in zip(slots, pages)])  # type: ignore[misc]
        except OSError:
            assert faulty, "a fault-free tier failed a write"
            for slot in slots:
                tier.unreserve(slot)  # type: ignore[arg-type]
            assert not any(tier.contains(header.key) for header, _ in pages), "a batch cut short stored a page"
            continue
        break
    else:
        pytest.fail("30 batches of 4 pages failed")
    num_read, _, _ = _read(tier, list(range(20, 24)))
    assert faulty or num_read == 4
