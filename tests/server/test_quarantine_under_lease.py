"""A landing page quarantined while a reader's lease pins it keeps its slot until the last pin
goes, as a removed page's does (Residence.drop): the slot is not handed to the next page
written, so no reader of the lease reads another page's bytes there (an unchecked gRPC send
copies the slot as it is). Bug pinned: the quarantine freed the slot at once, and the next
allocation took it while the lease still named it."""

from __future__ import annotations

from support.core_pages import CorePages, page_keys
from support.servers import make_config

from kvstore.server.placement import Placement


def test_a_quarantined_page_keeps_its_slot_until_its_readers_let_go(tmp_path) -> None:
    core = Placement(make_config(tmp_path, host_bytes=4 << 20))
    try:
        pages = CorePages(b"quarantine-lease")
        keys = page_keys("leased", 4)
        assert pages.put(core, keys) == 4
        lease, acquired = core.acquire(pages.ns, keys, 0)
        slot = acquired[2].slot
        core.reads.quarantine_landing(acquired[2].header, "a reader's check failed", slot)
        assert keys[2] in [q.key for q in core.quarantined()]
        assert core.residence.has(keys[2], 0) is False
        after = page_keys("written-after", 124)
        assert pages.put(core, after) == 124
        assert slot not in [core.landing.part_of(k).find(k)[0] for k in after], "the leased slot was handed out"
        assert not core.view().idle, "the slot waits for the lease"
        core.release(lease)
        assert core.view().idle, "freed once the lease went"
    finally:
        core.close()
