"""The SSD copies an invalidation owes a removal go in one index transaction per tier
part, not one a page: each transaction is synced, so a namespace of N pages on SSD cost
N syncs (128 pages: ~0.7 s of Invalidate here) where one does."""

from __future__ import annotations

import hashlib

import pytest
from support.servers import make_config

from kvstore.page import LayoutDesc, checksum
from kvstore.server.placement import Placement
from kvstore.tiers.ssd_index import SsdIndex

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages
NS = b"owed-namespace!!"


def _payload(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (LAYOUT.page_bytes // 64)


@pytest.mark.parametrize("pages", [1, 64])
def test_an_invalidated_namespace_leaves_the_ssd_index_in_one_transaction(tmp_path, monkeypatch, pages: int) -> None:
    core = Placement(make_config(tmp_path, host_bytes=8 << 20, ssd_bytes=16 << 20))
    try:
        keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(pages)]
        alloc, slots = core.allocate(NS, LAYOUT, keys)
        for key, _ in slots:
            core.slot_view(alloc, key)[:] = _payload(key)
        assert core.commit(alloc, keys, [checksum(_payload(k)) for k in keys], durable=True) == pages
        assert all("ssd" in core.where(k) for k in keys)
        deletes: list[int] = []
        real = SsdIndex.delete
        monkeypatch.setattr(SsdIndex, "delete", lambda index, gone: (deletes.append(len(gone)), real(index, gone))[1])
        assert core.invalidate(NS, []) == pages
        assert deletes == [pages], f"index deletes of the invalidated pages: {deletes}"
        assert not any(core.where(k) for k in keys)
    finally:
        core.close()
    reopened = Placement(make_config(tmp_path, host_bytes=8 << 20, ssd_bytes=16 << 20))
    try:  # the deletes were durable: nothing of the old generation comes back
        assert not any(reopened.where(k) for k in keys)
    finally:
        reopened.close()
