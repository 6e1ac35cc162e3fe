"""Page key -> locations, in memory for lookups and in LMDB for what must survive a restart.

More: kvstore/directory/README.md (### store.py).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from kvstore.config import MAP_BYTES
from kvstore.directory.entry import DURABLE_TIERS, Entry, walk_python
from kvstore.directory.events import EventKind, EventLog
from kvstore.directory.generations import Generations
from kvstore.errors import LimitExceeded
from kvstore.lmdb_env import map_full, open_env
from kvstore.types import Location, LocationRun

logger = logging.getLogger(__name__)

_SEQ_KEY = b"last_seq"
_MAX_WHERES = 4096  # distinct (node, tier, page size) places kept shared; past it they start over


try:
    from kvstore._lookup import walk as _walk
except ImportError:  # built without a C compiler (setup.py)
    _walk = walk_python
_ENTRY_NS, _ENTRY_WHERE = Entry.__dict__["namespace_id"], Entry.__dict__["where"]  # slot descriptors, for the native walk


class Directory:
    def __init__(self, data_dir: Path, node: str, map_bytes: int = MAP_BYTES) -> None:
        self.node = node
        self.env = open_env(data_dir / "directory.lmdb", map_bytes, max_dbs=6, metasync=False, sync=True)
        self.entries_db = self.env.open_db(b"entries")
        self.meta_db = self.env.open_db(b"meta")
        self._generations = Generations(self.env)
        self._entries: dict[bytes, Entry] = {}
        self._remote: Counter[str] = Counter()  # other node -> locations recorded for it
        self._usage: dict[bytes, Counter[str]] = {}  # namespace -> tier -> bytes here (remote: locations); tenant quotas
        self._version = 0
        self._wheres: dict[tuple[str, str, int], tuple[str, str, int]] = {}  # the cached best places, shared (lookup)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        with self.env.begin(db=self.meta_db) as txn:
            raw = txn.get(_SEQ_KEY)
        last_seq = int(raw) if raw else 0
        self.events = EventLog(first_seq=last_seq + 1)
        self._load()

    def _load(self) -> None:
        with self.env.begin(db=self.entries_db) as txn:
            for key, value in txn.cursor():
                rec = json.loads(bytes(value))
                entry = Entry(bytes.fromhex(rec["ns"]))
                for node, tier, version, size in rec["locs"]:
                    entry.locations[(node, tier)] = Location(node, tier, version, size)
                    self._count(node, 1)
                    self._account(entry.namespace_id, entry.locations[(node, tier)], 1)
                    self._version = max(self._version, version)
                self._entries[bytes(key)] = entry
        logger.info("directory: %d entries loaded", len(self._entries))

    def _persist(self, rows: dict[bytes, tuple[bytes, list[Location]]], last_seq: int) -> None:
        """Writes the durable locations ``rows`` (key -> namespace, locations; none: the
        key is deleted) and the event sequence, in one transaction. Called before memory
        changes: when it raises (MetadataFull), nothing changed anywhere."""
        with map_full(self.env, "the directory"), self.env.begin(write=True) as txn:
            for key, (namespace_id, durable) in rows.items():
                if durable:
                    rec = {"ns": namespace_id.hex(), "locs": [[l.node, l.tier, l.version, l.size_bytes] for l in durable]}
                    txn.put(key, json.dumps(rec, separators=(",", ":")).encode(), db=self.entries_db)
                else:
                    txn.delete(key, db=self.entries_db)
            txn.put(_SEQ_KEY, str(last_seq).encode(), db=self.meta_db)

    # -- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def generation(self, namespace_id: bytes) -> int:
        """The namespace's generation here (generations.py): 0 until an invalidation raised it."""
        return self._generations.get(namespace_id)

    def generations(self) -> dict[bytes, int]:
        """Every namespace whose generation was raised here, with it."""
        return self._generations.items()

    def lookup(self, namespace_id: bytes, keys: list[bytes]) -> list[LocationRun]:
        """The longest contiguous present prefix of ``keys``, as runs of pages whose best
        location is on the same node, tier and page size (a 512-page prefix in RAM: one run).
        The walk is native (csrc/_lookup.c) where built; an entry whose best location is
        not cached yet gets it here, and the walk goes on from it."""
        keys = keys if type(keys) is list else list(keys)
        runs: list[list] = []  # [where, pages]
        with self._lock:
            entries, start = self._entries, 0
            while True:
                start, stopped = _walk(entries, keys, namespace_id, start, runs, Entry, _ENTRY_NS, _ENTRY_WHERE)
                if stopped:
                    break
                entry = entries[keys[start]]
                if not entry.locations:
                    break
                loc = entry.best(self.node)
                where = (loc.node, loc.tier, loc.size_bytes)
                if len(self._wheres) >= _MAX_WHERES:
                    self._wheres.clear()
                entry.where = self._wheres.setdefault(where, where)  # one object per place: the walk compares identity first
        return [LocationRun(where[0], where[1], pages, where[2]) for where, pages in runs]

    def prefix_length(self, namespace_id: bytes, keys: list[bytes], node: str | None = None) -> int:
        """How many leading ``keys`` are present in ``namespace_id`` (at ``node``, when given); a publish's pages are seen all or none."""
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or entry.namespace_id != namespace_id or not any(node in (None, n) for n, _ in entry.locations):
                    return i
        return len(keys)

    def num_remote(self, node: str | None = None) -> int:
        """Locations recorded for ``node`` (None: for every other node)."""
        return self._remote[node] if node is not None else self._remote.total()

    def check_remote_room(self, records: list[tuple[bytes, str, str, int]], per_node: int, total: int) -> None:
        """Raises LimitExceeded when publishing ``records`` would hold more than ``per_node``
        locations of one other node or ``total`` of all; a location known already counts once."""
        added: Counter[str] = Counter()
        seen = set()
        for key, node, tier, _ in records:
            entry = self._entries.get(key)
            if node == self.node or (key, node, tier) in seen or (entry is not None and (node, tier) in entry.locations):
                continue
            seen.add((key, node, tier))
            added[node] += 1
        for node, count in added.items():
            if self._remote[node] + count > per_node:
                raise LimitExceeded(f"publish refused: node {node} would have {self._remote[node] + count} locations here, "
                                    f"at most {per_node} (--max-remote-records-per-node); nothing was published")
        if self._remote.total() + added.total() > total:
            raise LimitExceeded(f"publish refused: other nodes would have {self._remote.total() + added.total()} locations "
                                f"here, at most {total} (--max-remote-records); nothing was published")

    def usage(self, namespace_id: bytes) -> dict[str, int]:
        """What the namespace holds: this node's tiers in bytes, ``remote`` in locations."""
        with self._lock:
            return dict(self._usage.get(namespace_id, ()))

    def _account(self, namespace_id: bytes, loc: Location, sign: int) -> None:
        """Lock held: a location of ``namespace_id`` came (1) or went (-1)."""
        if loc.node == self.node:
            what, amount = loc.tier, loc.size_bytes
        elif loc.tier in DURABLE_TIERS:
            what, amount = loc.tier, 1
        else:
            return
        usage = self._usage.get(namespace_id)
        if usage is None:
            usage = self._usage[namespace_id] = Counter()
        usage[what] += sign * amount

    def _count(self, node: str, change: int) -> None:
        if node != self.node:
            self._remote[node] += change
            if self._remote[node] <= 0:
                del self._remote[node]

    def keys_of(self, namespace_id: bytes) -> list[bytes]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.namespace_id == namespace_id]

    def all_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    def locations_of(self, node: str) -> list[tuple[bytes, bytes, Location, int]]:
        """(key, namespace, location, the namespace's generation) of every location on ``node``
        (cluster mode: what a node publishes of its own, or holds of another's), read at once:
        a location is never paired with a generation raised after it went."""
        gen = self._generations.get
        with self._lock:
            return [(k, e.namespace_id, loc, gen(e.namespace_id)) for k, e in self._entries.items()
                    for loc in e.locations.values() if loc.node == node]

    # -- changes -------------------------------------------------------------------------

    def publish(self, namespace_id: bytes, records: list[tuple[bytes, str, str, int]],
                generation: int | None = None) -> list[int]:
        """Records (key, node, tier, size) whose bytes are durable in that tier; bumps versions.
        Durable locations are committed to LMDB first; on MetadataFull nothing changed. With
        ``generation``: StaleGeneration, nothing published, unless the namespace is at it."""
        with self._write_lock:
            if generation is not None:
                self._generations.require(namespace_id, generation)
            return self._publish(namespace_id, records)

    def publish_listed(self, namespace_id: bytes, records: list[tuple[bytes, str, str, int]],
                       generation: int) -> set[bytes]:
        """Publishes further copies, of ``generation``, of pages still listed in ``namespace_id``;
        one removed meanwhile is left out (no resurrection by a copy finished after its
        removal), and every one when the namespace left ``generation`` (a key listed again by a
        put of the new generation is not this copy's page). Returns the keys published."""
        with self._write_lock:
            if generation != self._generations.get(namespace_id):
                return set()
            entries = self._entries
            listed = [r for r in records if (e := entries.get(r[0])) is not None and e.namespace_id == namespace_id and e.locations]
            if listed:
                self._publish(namespace_id, listed)
            return {r[0] for r in listed}

    def publish_remote(self, namespace_id: bytes, records: list[tuple[bytes, str, str, int]], per_node: int,
                       total: int, generation: int | None = None) -> list[int]:
        """``publish`` of other nodes' locations, all or none, refused (LimitExceeded) when it
        would hold more than ``per_node`` locations of one node or ``total`` of all, and
        (StaleGeneration) when the namespace is not at ``generation``, if given."""
        with self._write_lock:
            if generation is not None:
                self._generations.require(namespace_id, generation)
            self.check_remote_room(records, per_node, total)
            return self._publish(namespace_id, records)

    def _publish(self, namespace_id: bytes, records: list[tuple[bytes, str, str, int]]) -> list[int]:
        staged = [(key, Location(node, tier, self._version + i, size)) for i, (key, node, tier, size) in enumerate(records, 1)]
        rows: dict[bytes, tuple[bytes, list[Location]]] = {}
        for key, loc in staged:
            if loc.tier in DURABLE_TIERS:
                prior = rows.get(key)
                if prior is None:
                    entry = self._entries.get(key)
                    prior = (entry.namespace_id, entry.durable()) if entry else (namespace_id, [])
                ns, durable = prior
                rows[key] = (ns, [l for l in durable if (l.node, l.tier) != (loc.node, loc.tier)] + [loc])
        if rows:
            self._persist(rows, self.events.last_seq + len(staged))
        generation = self._generations.get(namespace_id)
        try:
            with self._lock:
                for key, loc in staged:
                    entry = self._entries.setdefault(key, Entry(namespace_id))
                    old = entry.locations.get((loc.node, loc.tier))
                    if old is None:
                        self._count(loc.node, 1)
                    else:
                        self._account(entry.namespace_id, old, -1)
                    self._account(entry.namespace_id, loc, 1)
                    entry.locations[(loc.node, loc.tier)] = loc
                    entry.where = None
                    self.events.append(EventKind.STORED, namespace_id, key, loc, generation, wake=False)
                self._version += len(staged)
        finally:  # the waiters woken even if an entry's accounting raised
            self.events.stored(namespace_id, frozenset(loc.node for _, loc in staged))
        return [loc.version for _, loc in staged]

    def restore_local(self, records: list[tuple[bytes, bytes, str, int]]) -> None:
        """Rebuilds entries (key, namespace, tier, size) of this node's durable tiers at
        start, without events: subscribers resync after a restart anyway. Before serving."""
        entries, node, version = self._entries, self.node, self._version
        for key, namespace_id, tier, size in records:
            entry = entries.get(key)
            if entry is None:
                entry = entries[key] = Entry(namespace_id)
            else:
                entry.where = None
            version += 1
            old = entry.locations.get((node, tier))
            if old is not None:
                self._account(entry.namespace_id, old, -1)
            entry.locations[(node, tier)] = Location(node, tier, version, size)
            self._account(entry.namespace_id, entry.locations[(node, tier)], 1)
        self._version = version

    def remove(self, key: bytes, node: str | None = None, tier: str | None = None,
               up_to_version: int | None = None) -> list[Location]:
        """Drops the locations of ``key`` matching node/tier (all when None), those published
        up to ``up_to_version`` only when given; returns them. On MetadataFull (a durable one
        could not be deleted) nothing changed."""
        with self._write_lock:
            entry = self._entries.get(key)
            if entry is None:
                return []
            gone = [loc for loc in entry.locations.values()
                    if (node is None or loc.node == node) and (tier is None or loc.tier == tier)
                    and (up_to_version is None or loc.version <= up_to_version)]
            if any(loc.tier in DURABLE_TIERS for loc in gone):
                kept = [loc for loc in entry.durable() if loc not in gone]
                self._persist({key: (entry.namespace_id, kept)}, self.events.last_seq + len(gone))
            with self._lock:
                for loc in gone:
                    del entry.locations[(loc.node, loc.tier)]
                    entry.where = None
                    self._count(loc.node, -1)
                    self._account(entry.namespace_id, loc, -1)
                    self.events.append(EventKind.REMOVED, entry.namespace_id, key, loc)
                if not entry.locations:
                    del self._entries[key]
            return gone

    @property
    def version(self) -> int:
        """The version the last published location got (versions only grow)."""
        return self._version

    def drop_node(self, node: str, up_to_version: int | None = None) -> int:
        """Removes the locations on another node (it left the cluster, or registered again:
        its records are stale), those published up to ``up_to_version`` only when given (a
        node that registered again republishes at once: what it sent since must stay).
        Returns how many went; the locations of this node are never touched here."""
        if node == self.node:
            raise ValueError("drop_node is for other nodes' locations")
        gone = 0
        for key, _, loc, _ in self.locations_of(node):
            if up_to_version is None or loc.version <= up_to_version:  # checked again under the write lock:
                gone += len(self.remove(key, node, loc.tier, up_to_version))  # a republish since the listing stays
        return gone

    def drop_others(self, up_to_version: int) -> int:
        """Removes every other node's locations published up to ``up_to_version`` (this node
        registered again as their owner); returns how many went."""
        with self._lock:
            nodes = list(self._remote)
        return sum(self.drop_node(node, up_to_version) for node in nodes)

    def persist_generation(self, namespace_id: bytes, generation: int) -> bool:
        """``persist_generations`` of one namespace: False when it is at ``generation`` or above."""
        return bool(self.persist_generations({namespace_id: generation}))

    def persist_generations(self, raised: Mapping[bytes, int]) -> dict[bytes, int]:
        """Writes each namespace's generation of ``raised`` that is above its own, in one transaction,
        synced once; returns those (none written for the others). Memory follows with ``enter_generations``:
        a crash between the two leaves the raised generations on disk, and recovery drops the older pages it finds."""
        with self._write_lock:
            above = {ns: g for ns, g in raised.items() if g > self._generations.get(ns)}
            unwritten = {ns: g for ns, g in above.items() if g > self._generations.durable(ns)}
            if unwritten:
                with map_full(self.env, "the directory"), self.env.begin(write=True) as txn:
                    for namespace_id, generation in unwritten.items():
                        self._generations.put(txn, namespace_id, generation)
                self.env.sync(True)  # the env skips the meta sync (metasync=False): an OS crash must not undo a raise
                for namespace_id, generation in unwritten.items():
                    self._generations.written(namespace_id, generation)
            return above

    def enter_generation(self, namespace_id: bytes, generation: int) -> list[tuple[bytes, list[Location]]] | None:
        """``enter_generations`` of one namespace: None when it is at ``generation`` or above already."""
        return self.enter_generations({namespace_id: generation}).get(namespace_id)

    def enter_generations(self, raised: Mapping[bytes, int]) -> dict[bytes, list[tuple[bytes, list[Location]]]]:
        """Raises each namespace of ``raised`` to its generation there and removes every entry of it, the
        older generation's: one CLEARED event each. Returns the entries removed of each namespace raised;
        those at their generation or above already are left out (nothing changed). Writes to LMDB, in one
        transaction, only what ``persist_generations`` did not (a caller holding a lock no disk sync may
        run under calls that first). On MetadataFull nothing changed."""
        with self._write_lock:
            above = {ns: g for ns, g in raised.items() if g > self._generations.get(ns)}
            if not above:
                return {}
            with self._lock:  # every namespace's keys in one pass
                keys: dict[bytes, list[bytes]] = {}
                for key, entry in self._entries.items():
                    if entry.namespace_id in above:
                        keys.setdefault(entry.namespace_id, []).append(key)
            rows = [k for of in keys.values() for k in of if self._entries[k].durable()]
            unwritten = {ns: g for ns, g in above.items() if g > self._generations.durable(ns)}
            if rows or unwritten:
                with map_full(self.env, "the directory"), self.env.begin(write=True) as txn:
                    for namespace_id, generation in unwritten.items():
                        self._generations.put(txn, namespace_id, generation)
                    for key in rows:
                        txn.delete(key, db=self.entries_db)
                    txn.put(_SEQ_KEY, str(self.events.last_seq + len(above)).encode(), db=self.meta_db)
                for namespace_id, generation in unwritten.items():
                    self._generations.written(namespace_id, generation)
            removed: dict[bytes, list[tuple[bytes, list[Location]]]] = {}
            with self._lock:
                for namespace_id, generation in above.items():
                    self._generations.set(namespace_id, generation)
                    removed[namespace_id] = gone = [(k, list(self._entries.pop(k).locations.values()))
                                                    for k in keys.get(namespace_id, ())]
                    for _, locations in gone:
                        for loc in locations:
                            self._count(loc.node, -1)
                    self._usage.pop(namespace_id, None)
                    self.events.append(EventKind.CLEARED, namespace_id, generation=generation)
            return removed

    def close(self) -> None:
        self.events.close()
        self.env.close()
