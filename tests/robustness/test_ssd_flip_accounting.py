"""ssd_flip's accounting (348ab1f) names only the page whose bytes it flipped; the model lets (b)
lose only those. But ad15835's own rule is that a damaged index entry costs itself *and the
entry whose slot it names*: an offset flip that lands on another page's slot loses that page
too, and ssd_flip does not name it. Byte 2 of an offset inverted moves it by 0xFF0000 - 2*(bits),
a multiple of 20 KiB slots (0xFF0000 = 816 x 20,480) for offsets below 64 KiB: slot 1 -> slot 817.
Fixed in the tier, not the fault: where entries conflict, the slot's header on disk names its
page, which is kept (tiers/ssd.py ``_holds``); the flipped entry alone is lost, as ssd_flip says."""

from __future__ import annotations

import random
from pathlib import Path

from support.ssd_pages import store_pages

from kvstore.bench.chaos.ssd_flip import flip_ssd
from kvstore.config import SsdTierConfig
from kvstore.page import LayoutDesc
from kvstore.tiers.ssd import SsdTier


class Scripted(random.Random):
    """Picks the page at ``offset``, an index flip, and byte ``at`` of the entry (the offset's byte 2)."""

    def __init__(self, offset: int, at: int) -> None:
        super().__init__(0)
        self.offset, self.at = offset, at

    def choice(self, seq):  # type: ignore[override]
        return next(p for p in seq if p.offset == self.offset)

    def random(self) -> float:
        return 0.999  # the index entry (past payload 70 % + header 15 %)

    def randrange(self, *args, **kwargs) -> int:  # type: ignore[override]
        return self.at


def test_an_index_flip_names_every_page_it_costs(tmp_path: Path) -> None:
    layout = LayoutDesc(2, 2, 2, 64, "float16", 16)  # 16 KiB payload, 20 KiB slots
    config = SsdTierConfig(tmp_path, capacity_bytes=32 << 20, dwpd=0)
    tier = SsdTier(config)
    payloads, slots = store_pages(tier, layout, 819, random.Random(1))  # slab 0 full: slots 0..818
    tier.close()
    assert 20480 in slots.values() and 817 * 20480 in slots.values()
    damage = flip_ssd(tmp_path, Scripted(20480, 2), 1)
    assert damage.places["index"] == 1
    tier = SsdTier(config)
    try:
        lost = []
        for key, payload in payloads.items():
            into = bytearray(len(payload))
            if not (tier.read_into([(key, memoryview(into))]).num_read == 1 and into == payload):
                lost.append(key.hex())
        assert sorted(lost) == sorted(damage.keys), f"lost {lost}, the fault names {damage.keys}"
    finally:
        tier.close()
