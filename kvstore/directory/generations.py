"""Each namespace's generation: a whole-namespace invalidation raises it, nothing lowers it.

A page, a record, an allocation and a fetch belong to the generation they were made in; one
of an older generation than its namespace's is dead wherever it turns up (a fetch that lands
late, a lagging node's publish, a page a crash left on SSD), so an invalidation does not have
to chase every copy in flight. The table lives in the directory's LMDB (written synced before
memory changes), so a restart knows which of its SSD pages are dead before it serves one; in
cluster mode etcd holds the cluster's copy and every node re-seeds an etcd that lost it.
"""

from __future__ import annotations

import lmdb

from kvstore.errors import StaleGeneration

_U64 = 1 << 64


def check(generation: int, what: str = "generation") -> int:
    """``generation`` as a table value (an int in [0, 2**64)); InvalidRequest-free: callers validated it."""
    if not 0 <= generation < _U64:
        raise ValueError(f"{what} {generation} is outside [0, 2**64)")
    return generation


class Generations:
    """In memory for every read (a dict lookup), in LMDB for restarts. Not thread-safe by
    itself: the directory changes it under its write lock and reads it under its own lock or
    none (a dict read)."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._db = env.open_db(b"generations")
        self._values: dict[bytes, int] = {}  # what memory goes by
        with env.begin(db=self._db) as txn:
            for key, value in txn.cursor():
                self._values[bytes(key)] = int(bytes(value))
        self._durable = dict(self._values)  # what LMDB holds: ahead of memory while a raise is under way

    def get(self, namespace_id: bytes) -> int:
        return self._values.get(namespace_id, 0)

    def durable(self, namespace_id: bytes) -> int:
        return self._durable.get(namespace_id, 0)

    def items(self) -> dict[bytes, int]:
        """Every namespace whose generation was ever raised here, with it (a copy)."""
        return dict(self._values)

    def put(self, txn: lmdb.Transaction, namespace_id: bytes, generation: int) -> None:
        """Writes ``generation`` in the caller's write transaction; ``written`` once it committed,
        then memory follows with ``set``."""
        txn.put(namespace_id, str(check(generation)).encode(), db=self._db)

    def written(self, namespace_id: bytes, generation: int) -> None:
        self._durable[namespace_id] = max(generation, self.durable(namespace_id))

    def set(self, namespace_id: bytes, generation: int) -> None:
        self._values[namespace_id] = generation

    def require(self, namespace_id: bytes, generation: int) -> None:
        """Raises StaleGeneration unless the namespace is at ``generation``: a call made in
        another one changes nothing."""
        current = self.get(namespace_id)
        if generation != current:
            raise StaleGeneration(stale_message(namespace_id, generation, current), current)


def stale_message(namespace_id: bytes, named: int, current: int) -> str:
    older = "an older" if named < current else "a newer"
    return (f"namespace {namespace_id.hex()} is at generation {current}; the call names {older} one ({named}) "
            "and changed nothing")


def stale_commit_message(namespace_id: bytes, allocated: int, current: int) -> str:
    """A commit refused because its allocation's generation is over. Why apart from ``stale_message``:
    the call may have named no generation (the allocation takes the current one), so "the call
    names" would blame it for a number it never sent."""
    return (f"namespace {namespace_id.hex()} is at generation {current}: an invalidation raised it after these pages "
            f"were allocated in generation {allocated}, so they are not stored; look the prefix up again and write the pages "
            f"computed from what it finds (generation {current})")
