"""A demotion write-down in flight across an invalidation while the same key is put again in
the new generation, durably (DESIGN §12.4, found by a review of 462107e): the old generation's SSD
copy was published as the new one's (the directory listed the key, by the new put), the durable
commit counted it as written, and after a restart recovery deleted it: an acknowledged durable
put lost. A copy is published only in its own generation."""
from __future__ import annotations

import dataclasses
import hashlib
import threading
import time

from support.servers import make_config

from kvstore.page import LayoutDesc, checksum
from kvstore.server.placement import Placement
from kvstore.tiers.base import Tier, TierWrapper

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)
NS = b"race-namespace!!"
K = hashlib.blake2b(b"k", digest_size=16).digest()


def payload(tag: bytes) -> bytes:
    return hashlib.blake2b(tag, digest_size=64).digest() * (LAYOUT.page_bytes // 64)


class Gate(TierWrapper):
    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.armed = False
        self.entered = threading.Event()
        self.go = threading.Event()

    def write(self, pages):  # type: ignore[no-untyped-def]
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.go.wait(10)
        self.inner.write(pages)


def put(core: Placement, data: bytes, durable: bool = False) -> int:
    alloc, slots = core.allocate(NS, LAYOUT, [K])
    for key, slot in slots:
        if slot is not None:
            core.slot_view(alloc, key)[:] = data
    return core.commit(alloc, [K], [checksum(data)], durable=durable)


def read(core: Placement) -> bytes | None:
    lease, pages = core.acquire(NS, [K], 0)
    try:
        return bytes(core.read_view(pages[0])) if pages else None
    finally:
        core.release(lease)


def test_a_demotion_across_an_invalidation_does_not_stand_in_for_a_durable_put_of_the_new_generation(tmp_path) -> None:
    config = make_config(tmp_path, host_bytes=4 << 20, ssd_bytes=16 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.001, demote_to=0.001))
    gates: list[Gate] = []

    def wrap(tier: Tier) -> Tier:
        if tier.name == "ssd":
            gates.append(Gate(tier))
            return gates[-1]
        return tier

    core = Placement(config, wrap=wrap)
    old, new = payload(b"old"), payload(b"new")
    try:
        assert put(core, old) == 1
        gates[0].armed = True
        demoter = threading.Thread(target=core.demote_one)
        demoter.start()
        assert gates[0].entered.wait(5)
        core.invalidate(NS, [])  # generation 1
        assert core.directory.generation(NS) == 1
        acked = []
        writer = threading.Thread(target=lambda: acked.append(put(core, new, durable=True)))
        writer.start()
        time.sleep(0.3)
        gates[0].go.set()
        demoter.join(10)
        writer.join(10)
        assert acked == [1]
        assert core.lower[0].find(K)[1].generation == 1, "the SSD copy of the acknowledged durable put is generation 0's"
        assert read(core) == new
        with core.keeper.critical():
            core.moves.evict_one(0)  # the landing copy goes (any eviction)
        assert read(core) == new, "the directory lists an SSD copy that is not served"
    finally:
        core.close()
    core = Placement(config)  # restart
    try:
        assert read(core) == new, "an acknowledged durable put of generation 1 is lost after a restart"
    finally:
        core.close()
