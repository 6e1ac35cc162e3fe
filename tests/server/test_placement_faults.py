"""The real placement core over a failing SSD tier (FaultyTier: I/O errors, short reads,
corrupt bytes, delays): seeded random traffic never gets a byte that was not put past
its reader's checksum (a damaged page fails it, is reported and dropped), and
when the traffic stops nothing stays pinned, allocated or leased. Also: no lock that
lookups or allocations take is held over the SSD's I/O."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import time
from pathlib import Path

import grpc
import pytest
from support.servers import make_config

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError
from kvstore.page import LayoutDesc, checksum
from kvstore.server import Server
from kvstore.server.placement import Demoter, Placement
from kvstore.server.placement.reported import check_reported
from kvstore.tiers.base import Tier
from kvstore.tiers.faulty import FaultyTier

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages: 128 of them fill a 4 MiB host tier
NS = b"faulty-namespace"


def _payload(key: bytes) -> bytes:
    """A key names its bytes (as a prefix hash names its KV)."""
    return hashlib.blake2b(key, digest_size=64).digest() * (LAYOUT.page_bytes // 64)


def _keys(prefix: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{prefix}/{i}".encode(), digest_size=16).digest() for i in range(n)]


class _Undeleted(FaultyTier):
    """Remembers the keys of every delete it failed (their copies may stay)."""

    def __init__(self, inner: Tier, seed: int, **faults: float) -> None:
        super().__init__(inner, seed, **faults)
        self.undeleted: set[bytes] = set()

    def delete(self, keys: list[bytes], evicted: bool = False) -> int:
        try:
            return super().delete(keys, evicted)
        except OSError:
            self.undeleted.update(keys)
            raise


def _faulty_ssd(seed: int, **faults: float):  # -> (a Wrap, the FaultyTiers it made)
    made: list[_Undeleted] = []

    def wrap(tier: Tier) -> Tier:
        if tier.name != "ssd":
            return tier
        made.append(_Undeleted(tier, seed, **faults))
        return made[-1]

    return wrap, made


def _put(core: Placement, keys: list[bytes], durable: bool) -> None:
    try:
        alloc, slots = core.allocate(NS, LAYOUT, keys)
    except KVStoreError:
        return
    written = [k for k, slot in slots if slot is not None]
    for key in written:
        core.slot_view(alloc, key)[:] = _payload(key)
    try:
        core.commit(alloc, written, [checksum(_payload(k)) for k in written], durable=durable)
    except KVStoreError:  # the ssd tier failed or refused the durable part: the pages stay in RAM
        pass


def _get(core: Placement, keys: list[bytes]) -> int:
    try:
        lease, pages = core.acquire(NS, keys, 0)
    except KVStoreError:
        return 0
    try:
        for n, page in enumerate(pages):
            got = bytes(core.read_view(page))
            if checksum(got) != page.checksum:
                # A copy damaged on disk, read up unchecked: its reader's check finds it (DESIGN §4),
                # as a client's does, and reports it (the arena copy is dropped then, unless another
                # thread removed and stored the key again meanwhile: test_durability checks the drop)
                check_reported(core, lease, None, [page.key])
                return n
            assert got == _payload(page.key), f"page {page.key.hex()} was served with other bytes that pass its checksum"
    finally:
        core.release(lease)
    return len(pages)


def _traffic(core: Placement, rng: random.Random, steps: int) -> int:
    served = 0
    for _ in range(steps):
        prefix, n = rng.randrange(40), rng.randrange(1, 24)
        keys = _keys(prefix, n)
        op = rng.random()
        if op < 0.45:
            _put(core, keys, durable=rng.random() < 0.2)
        elif op < 0.9:
            served += _get(core, keys)
        elif op < 0.95:
            core.remove(NS, keys[rng.randrange(n) :])
        else:
            core.scrub_one()
    return served


def _config(tmp_path: Path) -> ServerConfig:
    return make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)


@pytest.mark.parametrize("seed", range(3))
def test_no_wrong_bytes_and_nothing_left_pinned_under_ssd_faults(tmp_path, seed: int) -> None:
    wrap, made = _faulty_ssd(seed, error_rate=0.1, short_read_rate=0.1, corrupt_rate=0.1)
    core = Placement(_config(tmp_path), wrap=wrap)
    try:
        served = _traffic(core, random.Random(seed), 600)
        assert served > 0 and made[0].injected["corrupt"] and made[0].injected["error"], (served, made[0].injected)
        view = core.view()
        assert view.idle and not view.moving, view
        core.invalidate(NS, [])
        view = core.view()
        assert view.tiers["host"].num_pages == 0 and view.tiers["host"].used_bytes == 0
        left = set(made[0].stored_keys())
        assert left <= made[0].undeleted, f"{len(left - made[0].undeleted)} copies stay that no failed delete named"
    finally:
        core.close()


def test_no_wrong_bytes_with_readers_writers_and_the_demoter_at_once(tmp_path) -> None:
    """The same checks with three traffic threads and the background demoter, the SSD tier
    slow and failing."""
    wrap, _ = _faulty_ssd(7, error_rate=0.05, short_read_rate=0.05, corrupt_rate=0.05, delay_s=0.002)
    core = Placement(_config(tmp_path), wrap=wrap)
    demoter = Demoter(core, idle_s=0.05)
    demoter.start()
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            _traffic(core, random.Random(seed), 250)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        demoter.stop()
        view = core.view()
        assert view.idle and not view.moving, view
    finally:
        demoter.stop()
        core.close()


def test_a_slow_ssd_write_blocks_no_lookup_acquire_or_allocation(tmp_path) -> None:
    """Before, the tier manager held its one lock while a demotion wrote, synced and
    indexed a page: with the SSD slowed to 1.5 s per write and per commit, an Acquire of a
    page in RAM, an Allocate and Stats waited the 3 s (seen on the old code with a delay
    patched into SsdTier.write_slot). Now only the pages being moved wait."""
    config = make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)
    wrap, made = _faulty_ssd(0, delay_s=1.5)
    server = Server(config, wrap=wrap)
    server.start()
    core = server.core
    try:
        ram = _keys(1, 120)
        _put(core, ram, durable=False)  # RAM only: every victim is written down first
        assert core.view().tiers["host"].num_pages == 120
        slow = threading.Thread(target=_put, args=(core, _keys(2, 10), False))  # needs room: demotes through the slow ssd
        slow.start()
        deadline = time.monotonic() + 10
        while not core.view().moving and time.monotonic() < deadline:  # reading, not steering: a demotion is under way
            time.sleep(0.01)
        assert core.view().moving, "no demotion started"
        timings = {}
        with grpc.insecure_channel(server.address) as channel:
            stub = directory_pb2_grpc.DirectoryStub(channel)
            start = time.monotonic()
            assert stub.Lookup(directory_pb2.LookupRequest(namespace_id=NS, keys=ram[-10:]), timeout=10).num_pages == 10
            timings["lookup"] = time.monotonic() - start
        start = time.monotonic()
        assert _get(core, ram[-10:]) == 10
        timings["acquire"] = time.monotonic() - start
        start = time.monotonic()
        alloc, _ = core.allocate(NS, LAYOUT, ram[-5:])  # stored already: answered without a slot
        core.abort(alloc)
        timings["allocate"] = time.monotonic() - start
        start = time.monotonic()
        core.stats()
        timings["stats"] = time.monotonic() - start
        assert made[0].injected == {} and slow.is_alive(), "the slow write was still under way"
        assert max(timings.values()) < 1.0, timings
        # measured: the rest of the round need not crawl at 1.5 s an I/O (~20 s; FaultyTier reads delay_s at each I/O)
        made[0].delay_s = 0.0
        slow.join(60)
        assert not slow.is_alive()
    finally:
        server.stop(grace_s=1)


def test_a_stop_waits_for_the_demotion_round_under_way(tmp_path, monkeypatch, caplog) -> None:
    """A server stopping while its demoter writes a round through a slow SSD waits for that
    round, then closes the tiers. Bug: Demoter.stop joined for 10 s and the server closed the
    tiers, the SSD file and its index under a demoter still writing (found in CI: the next
    test read the leftover thread; a reused descriptor could take its writes). The join's
    period is 0.5 s here and the round outlasts several (the warning each says so), so a
    bounded join of any length the stop might regress to fails as the 10 s one did."""
    monkeypatch.setattr("kvstore.server.placement.demoter.STOP_WARN_S", 0.5)
    config = make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.5, demote_to=0.05))
    wrap, _made = _faulty_ssd(0, delay_s=0.05)  # a round of 64 pages: ~3 s
    server = Server(config, wrap=wrap)
    before = {t.native_id for t in threading.enumerate()}
    server.start()
    demoters = [t for t in threading.enumerate() if t.name.startswith("demoter") and t.native_id not in before]
    assert len(demoters) == 2  # its background and urgent halves
    try:
        _put(server.core, _keys(1, 100), durable=False)  # past the watermark: the demoter starts a round
        deadline = time.monotonic() + 10
        while not server.core.view().moving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.core.view().moving, "no demotion started"
    finally:
        server.stop(grace_s=1)
    assert not any(t.is_alive() for t in demoters), "the server closed its tiers under a demoter still writing"
    assert any("still writing a round down" in r.getMessage() for r in caplog.records), "the round ended within one join"


class _Buggy(FaultyTier):
    """Its first write raises what no I/O error is (a bug below, a MemoryError)."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner, 0)
        self.raised = 0

    def write(self, pages):  # type: ignore[no-untyped-def]
        if not self.raised:
            self.raised += 1
            raise RuntimeError("injected: not an I/O error")
        return super().write(pages)


def test_a_write_that_fails_with_no_io_error_leaves_no_slot_or_page_held(tmp_path) -> None:
    """A write down that raised anything but OSError kept its lower-tier slots reserved and its
    pages marked as being written: the next eviction of them waited for that write forever."""
    made: list[_Buggy] = []

    def wrap(tier: Tier) -> Tier:
        if tier.name != "ssd":
            return tier
        made.append(_Buggy(tier))
        return made[-1]

    core = Placement(_config(tmp_path), wrap=wrap)
    try:
        _put(core, _keys(1, 120), durable=False)  # RAM only: every victim must be written down first
        with pytest.raises(RuntimeError, match="injected"):
            core.allocate(NS, LAYOUT, _keys(2, 10))
        assert made[0].raised == 1
        assert made[0].usage().used_bytes == 0, "the failed write's slots stay reserved"
        assert not core.view().moving
        done = threading.Thread(target=_put, args=(core, _keys(3, 10), False), daemon=True)
        done.start()
        done.join(10)
        assert not done.is_alive(), "the next eviction waits for the failed write"
        assert _get(core, _keys(3, 10)) == 10 and made[0].stored_keys(), "the put after it stored its pages, written down below"
    finally:
        core.close()
