"""The ``ssd_flip`` fault's bytes: a stray write to a node's SSD tier (``tiers/ssd*.py``), made
while the node is stopped so that no slot is freed or reused under it.

Only the bytes a read checks are flipped, in pages the tier's index lists: a payload byte
(its checksum), a byte of the slot's header (compared with the index's copy), or a byte of
the page's index entry (slot offset, size and header copy; read only at a restart). The
index is LMDB: an entry's bytes are found through this process's read-only map of it
(``/proc/self/maps``), so a flip changes a value, never LMDB's own tree. Which pages were
hit is returned: the chaos model may lose only those (converge.py)."""

from __future__ import annotations

import os
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np

from kvstore.page import HEADER_BYTES, HEADER_CORE_BYTES, PAYLOAD_BYTES_AT, PAYLOAD_BYTES_FIELD
from kvstore.tiers.ssd import INDEX_DIR
from kvstore.tiers.ssd_writes import DATA_FILE

_ENTRY = struct.Struct("<QQ")  # an index entry's offset and slot bytes, then the header core (tiers/ssd_index.py)
# Where a flip lands: a payload byte, a slot header byte, an index entry byte (the rest)
PAYLOAD_SHARE, HEADER_SHARE = 0.7, 0.15


@dataclass(frozen=True)
class IndexedPage:
    key: bytes
    offset: int  # its slot in the data file
    payload_bytes: int
    entry_at: int  # where its index entry's value lies in the index's data.mdb
    entry_bytes: int  # offset, size and header core: the part a restart reads and checks


@dataclass
class SsdDamage:
    """What one ``ssd_flip`` did: bytes per place, and the pages hit (hex keys)."""

    indexed: int = 0
    places: dict[str, int] = field(default_factory=lambda: {"payload": 0, "header": 0, "index": 0})
    keys: list[str] = field(default_factory=list)

    def describe(self) -> str:
        flips = ", ".join(f"{n} {place}" for place, n in self.places.items())
        return f"{sum(self.places.values())} bytes ({flips}) in {len(self.keys)} of {self.indexed} ssd pages"


def indexed_pages(ssd_dir: Path) -> list[IndexedPage]:
    """The pages the index lists, by slot; their entries located in data.mdb."""
    env = lmdb.open(str(ssd_dir / INDEX_DIR), readonly=True, lock=False, subdir=True, max_dbs=4)
    try:
        maps = _file_maps(ssd_dir / INDEX_DIR / "data.mdb")
        db = env.open_db(b"index", create=False)
        pages = []
        with env.begin(db=db, buffers=True) as txn:
            for key, value in txn.cursor():
                if len(value) < _ENTRY.size + HEADER_CORE_BYTES:
                    continue  # a format-1 entry or one already damaged: not a target
                offset, _ = _ENTRY.unpack_from(value)
                (payload,) = PAYLOAD_BYTES_FIELD.unpack_from(value, _ENTRY.size + PAYLOAD_BYTES_AT)
                pages.append(IndexedPage(bytes(key), offset, payload, _file_offset(maps, value), _ENTRY.size + HEADER_CORE_BYTES))
        return sorted(pages, key=lambda p: p.offset)
    finally:
        env.close()


def flip_ssd(ssd_dir: Path, rng: random.Random, count: int) -> SsdDamage:
    """Inverts ``count`` bytes of indexed pages (each flip a page drawn anew), synced, and
    says where and which pages. The node must be stopped meanwhile (``ChaosNode.flip_ssd_bytes``)."""
    damage = SsdDamage()
    pages = indexed_pages(ssd_dir)
    damage.indexed = len(pages)
    if not pages:
        return damage
    data = os.open(ssd_dir / DATA_FILE, os.O_RDWR)
    index = os.open(ssd_dir / INDEX_DIR / "data.mdb", os.O_RDWR)
    try:
        for _ in range(count):
            page = rng.choice(pages)
            draw = rng.random()
            if draw < PAYLOAD_SHARE and page.payload_bytes:
                fd, at, place = data, page.offset + HEADER_BYTES + rng.randrange(page.payload_bytes), "payload"
            elif draw < PAYLOAD_SHARE + HEADER_SHARE:
                fd, at, place = data, page.offset + rng.randrange(HEADER_CORE_BYTES), "header"
            else:
                fd, at, place = index, page.entry_at + rng.randrange(page.entry_bytes), "index"
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
            damage.places[place] += 1
            if page.key.hex() not in damage.keys:
                damage.keys.append(page.key.hex())
        os.fdatasync(data)  # the node reads with O_DIRECT: from the device
        os.fdatasync(index)
    finally:
        os.close(data)
        os.close(index)
    return damage


def _file_maps(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of this process's maps of ``path``."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n") == str(path.resolve()):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                found.append((start, end, int(parts[2], 16)))
    return found


def _file_offset(maps: list[tuple[int, int, int]], value: memoryview) -> int:
    address = np.frombuffer(value, dtype=np.uint8).ctypes.data
    for start, end, offset in maps:
        if start <= address < end:
            return offset + address - start
    raise RuntimeError("an index entry outside the index's map")
