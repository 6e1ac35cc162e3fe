"""The SSD tier's index: key -> (slot, page header) in LMDB, and the quarantine list.

An entry is written only after its page's bytes are synced, so a restart finds exactly the
pages that were whole. Write transactions are serialised by the index's own lock, held
over the commit (which syncs) but never over anything a reader needs: the tier's in-memory
map is changed only after a transaction succeeded. What each transaction costs the device
is charged to the write budget (``writes``, device_writes.py).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from kvstore.lmdb_env import map_full, open_env
from kvstore.page import HEADER_BYTES, HEADER_CORE_BYTES, KEY_AT, PAYLOAD_BYTES_AT, PAYLOAD_BYTES_FIELD, PageHeader, core_bytes
from kvstore.tiers.base import Quarantined, parent_links
from kvstore.tiers.device_writes import IndexWrites
from kvstore.tiers.slab import ALIGN, round_up

logger = logging.getLogger(__name__)

_ENTRY = struct.Struct("<QQ")  # offset, slot bytes; followed by the header core, then the parent key (16 bytes) if known


def slot_bytes(payload_bytes: int) -> int:
    """What one page takes on the device: its header, then its payload padded to 4 KiB."""
    return HEADER_BYTES + round_up(payload_bytes)


class SsdIndex:
    def __init__(self, path: Path, map_bytes: int, sync: bool) -> None:
        self.env = open_env(path, map_bytes, max_dbs=4, sync=sync)
        self.index_db = self.env.open_db(b"index")
        self.quarantine_db = self.env.open_db(b"quarantine")
        self.writes = IndexWrites()
        self._write_lock = threading.Lock()

    @contextmanager
    def _write_txn(self, num_entries: int, db: Any) -> Iterator[lmdb.Transaction]:
        """One write transaction: a full map is MetadataFull (nothing written), and what it
        costs the device is counted in ``writes``."""
        with self._write_lock, map_full(self.env, "the ssd index"), self.writes.transaction(num_entries), \
                self.env.begin(write=True, db=db) as txn:
            yield txn

    def load(self, data_file_bytes: int) -> tuple[list[tuple[bytes, int, int, bytes]], list[tuple[bytes, bytes]]]:
        """Every entry that can be right, as (key, offset, slot bytes, raw header core), and
        the (key, parent) links of those whose writer named a parent (entries of older
        versions name none); the others are dropped from the index, each said in the log."""
        dropped: list[tuple[bytes, str]] = []
        entries: list[tuple[bytes, int, int, bytes]] = []
        links: list[tuple[bytes, bytes]] = []
        unpack_entry, unpack_payload, add = _ENTRY.unpack_from, PAYLOAD_BYTES_FIELD.unpack_from, entries.append
        with self.env.begin(db=self.index_db, buffers=False) as txn:
            for key, value in txn.cursor():  # a million entries at start: inlined, no call per entry
                try:
                    offset, size = unpack_entry(value)
                    entry_end = _ENTRY.size + core_bytes(value[_ENTRY.size : _ENTRY.size + 8])  # format 1 or 2
                    raw = value[_ENTRY.size : entry_end]
                    (payload,) = unpack_payload(raw, PAYLOAD_BYTES_AT)
                except struct.error:
                    dropped.append((key, "unreadable index entry"))
                    continue
                if (raw[KEY_AT : KEY_AT + 16] != key or size != HEADER_BYTES + -(-payload // ALIGN) * ALIGN
                        or offset + size > data_file_bytes):
                    dropped.append((key, "index entry does not match the data file"))
                    continue
                add((key, offset, size, raw))
                if len(value) >= entry_end + 16:
                    links.append((key, value[entry_end : entry_end + 16]))
        self.drop(dropped)
        return entries, links

    def drop(self, entries: list[tuple[bytes, str]]) -> None:
        """Removes entries that cannot be right, saying why in the log."""
        for key, reason in entries:
            logger.warning("ssd tier: dropping index entry %s: %s", key.hex(), reason)
        if entries:
            self.delete([key for key, _ in entries])

    def put(self, entries: list[tuple[int, PageHeader]], parents: Sequence[bytes | None] = ()) -> None:
        """Indexes written, synced slots, each with its parent when known (the eviction order
        is rebuilt from them at a restart); on MetadataFull nothing was indexed."""
        links = parent_links(parents, len(entries))
        with self._write_txn(len(entries), self.index_db) as txn:
            for (offset, header), parent in zip(entries, links):
                value = _ENTRY.pack(offset, slot_bytes(header.payload_bytes)) + header.pack()[:HEADER_CORE_BYTES]
                txn.put(header.key, value + parent if parent is not None and len(parent) == 16 else value)

    def delete(self, keys: list[bytes]) -> None:
        with self._write_txn(len(keys), self.index_db) as txn:
            for key in keys:
                txn.delete(key)

    # -- quarantine ----------------------------------------------------------------------

    def quarantine(self, key: bytes, namespace_id: bytes, reason: str) -> None:
        """Lists a page as quarantined and drops its entry, in one transaction."""
        record = json.dumps({"namespace_id": namespace_id.hex(), "reason": reason, "unix_s": time.time()})
        with self._write_txn(2, self.quarantine_db) as txn:
            txn.put(key, record.encode())
            txn.delete(key, db=self.index_db)

    def quarantined(self, purge: bool = False) -> list[Quarantined]:
        """The quarantine list (``purge``: read and emptied in one write transaction)."""
        if not purge:
            with self.env.begin(db=self.quarantine_db) as txn:
                return _listed(txn)
        with self._write_txn(1, self.quarantine_db) as txn:
            listed = _listed(txn)
            txn.drop(self.quarantine_db, delete=False)
        return listed

    def close(self) -> None:
        self.env.close()


def _listed(txn: lmdb.Transaction) -> list[Quarantined]:
    out = []
    for key, value in txn.cursor():
        rec = json.loads(bytes(value))
        out.append(Quarantined(bytes(key), bytes.fromhex(rec["namespace_id"]), rec["reason"], rec["unix_s"]))
    return out
