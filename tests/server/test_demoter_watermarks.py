"""The demoter's two watermarks: it starts writing the landing tier down only once an
allocation fills it past ``demote_above`` and then goes on until ``demote_to``. Below the
high watermark it writes nothing, however long it idles: a page written down early costs
SSD endurance for nothing (it may be deleted before RAM is needed), and a drain begun on
every idle tick made the two watermarks one."""

from __future__ import annotations

import dataclasses
import hashlib
import time

from support.servers import make_config

from kvstore.page import LayoutDesc, checksum
from kvstore.server.placement import Placement
from kvstore.server.placement.demoter import Demoter

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages: 128 of them fill a 4 MiB host tier
NS = b"watermark-names!"
CAPACITY = 4 << 20


def _keys(start: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(start, start + n)]


def _put(core: Placement, keys: list[bytes], namespace_id: bytes = NS) -> None:
    for key in keys:  # one page per allocation: the fill crosses a watermark at a known page
        alloc, slots = core.allocate(namespace_id, LAYOUT, [key])
        payload = key * (LAYOUT.page_bytes // len(key))
        core.slot_view(alloc, slots[0][0])[:] = payload
        assert core.commit(alloc, [key], [checksum(payload)]) == 1


def _on_ssd(core: Placement, keys: list[bytes]) -> int:
    return sum("ssd" in core.where(key) for key in keys)


def test_the_demoter_writes_nothing_down_below_its_high_watermark_and_drains_to_its_low_one_past_it(tmp_path) -> None:
    config = make_config(tmp_path, host_bytes=CAPACITY, ssd_bytes=16 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.8, demote_to=0.1))
    core = Placement(config)
    demoter = Demoter(core, idle_s=0.02)
    demoter.start()
    try:
        pages = CAPACITY // LAYOUT.page_bytes
        first = _keys(0, int(0.5 * pages))  # half full: between the watermarks
        _put(core, first)
        time.sleep(0.5)  # 25 idle ticks of the demoter
        assert _on_ssd(core, first) == 0, "pages were written down below the high watermark"
        assert core.view().tiers["host"].num_pages == len(first)

        more = _keys(len(first), int(0.35 * pages))  # past 0.8
        _put(core, more)
        deadline = time.monotonic() + 30
        while core.view().tiers["host"].used_bytes > 0.1 * CAPACITY and time.monotonic() < deadline:
            time.sleep(0.02)
        used = core.view().tiers["host"].used_bytes
        assert used <= 0.1 * CAPACITY, f"the drain stopped at {used / CAPACITY:.2f} of the host tier, above its low watermark"
        assert _on_ssd(core, first + more) >= len(first + more) - int(0.1 * pages)
    finally:
        demoter.stop()
        core.close()


def test_with_tenant_arenas_only_an_arena_past_its_high_watermark_is_drained(tmp_path) -> None:
    """Each tenant's arena has its own watermarks: an arena that fills past ``demote_above``
    drains to ``demote_to``, and another tenant's arena between the two watermarks keeps its
    pages in RAM. Bug: the hysteresis was one flag for the whole tier, so once one arena had
    passed its high watermark every arena above its low one was drained too."""
    auth = tmp_path / "auth.json"
    auth.write_text("{}")  # names no one: only to make the server's callers tenants (one arena each)
    config = make_config(tmp_path, host_bytes=CAPACITY, ssd_bytes=32 << 20)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, demote_above=0.8, demote_to=0.1),
                                 security=dataclasses.replace(config.security, auth_file=auth))
    ns_a, ns_b = b"tenant-a-names!!", b"tenant-b-names!!"
    core = Placement(config, owner_of={ns_a: "a", ns_b: "b"}.__getitem__, arena_bytes=lambda tenant: CAPACITY)
    demoter = Demoter(core, idle_s=0.02)
    demoter.start()
    try:
        pages = CAPACITY // LAYOUT.page_bytes
        keys_b = _keys(0, int(0.5 * pages))  # b's arena half full: between its watermarks
        _put(core, keys_b, ns_b)
        keys_a = _keys(len(keys_b), int(0.85 * pages))  # a's past its high one
        _put(core, keys_a, ns_a)
        deadline = time.monotonic() + 30
        while _on_ssd(core, keys_a) < len(keys_a) - int(0.1 * pages) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _on_ssd(core, keys_a) >= len(keys_a) - int(0.1 * pages), "a's arena was not drained to its low watermark"
        time.sleep(0.5)  # 25 idle ticks
        assert _on_ssd(core, keys_b) == 0, "b's arena, never past its high watermark, was drained with a's"
    finally:
        demoter.stop()
        core.close()
