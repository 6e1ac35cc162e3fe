"""Pages written straight into a Placement core (no server), each payload derived from its key:
the placement tests' allocate / commit / read helpers, one namespace per ``CorePages``."""

from __future__ import annotations

import hashlib

from kvstore.page import LayoutDesc, checksum
from kvstore.server.placement import Placement

LAYOUT = LayoutDesc(4, 2, 2, 64, "float16", 16)  # 32 KiB pages: 128 of them fill a 4 MiB host tier


def page_keys(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def payload(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (LAYOUT.page_bytes // 64)


def in_host(core: Placement, keys: list[bytes]) -> list[bool]:
    return [core.residence.has(k, 0) for k in keys]  # tier 0: the landing tier


class CorePages:
    def __init__(self, namespace_id: bytes) -> None:
        self.ns = namespace_id

    def allocate(self, core: Placement, keys: list[bytes], parent: bytes | None = None) -> bytes:
        """An allocation of every page of ``keys`` (asserted), each slot written with its payload."""
        alloc, slots = core.allocate(self.ns, LAYOUT, keys, parent=parent)
        assert [k for k, _ in slots] == keys
        for key, slot in slots:
            if slot is not None:
                core.slot_view(alloc, key)[:] = payload(key)
        return alloc

    def commit(self, core: Placement, alloc: bytes, keys: list[bytes]) -> int:
        return core.commit(alloc, keys, [checksum(payload(k)) for k in keys])

    def put(self, core: Placement, keys: list[bytes], parent: bytes | None = None) -> int:
        return self.commit(core, self.allocate(core, keys, parent), keys)

    def found(self, core: Placement, keys: list[bytes]) -> int:
        """How many leading pages a lease gets, each read back as written."""
        lease, pages = core.acquire(self.ns, keys, 0)
        try:
            for page in pages:
                assert bytes(core.read_view(page)) == payload(page.key)
            return len(pages)
        finally:
            core.release(lease)
