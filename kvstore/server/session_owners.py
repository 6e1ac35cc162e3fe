"""Who owns each migrated session, as this node knows it (DESIGN §12.8).

More: kvstore/server/README.md (### session_owners.py).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.errors import InvalidRequest, SessionFenced, TierUnavailable
from kvstore.server.tokenlog import TokenLog
from kvstore.types import NAMESPACE_ID_BYTES

OWNED, FREEZING, FENCED, INCOMING = 1, 2, 3, 4
STATE_NAMES = {OWNED: "owned", FREEZING: "freezing", FENCED: "fenced", INCOMING: "incoming"}
_RECORD = struct.Struct("<QB")  # version, state; then the other node's id (utf-8)


@dataclass(frozen=True)
class Ownership:
    """``version``: the last version decided that this node knows of (FREEZING, INCOMING: the
    one the migration started from). ``node``: FREEZING and FENCED: the target; INCOMING: the
    source; OWNED: this node."""

    version: int
    state: int
    node: str

    def pack(self) -> bytes:
        return _RECORD.pack(self.version, self.state) + self.node.encode()

    @classmethod
    def unpack(cls, raw: bytes) -> Ownership:
        version, state = _RECORD.unpack_from(raw)
        return cls(version, state, bytes(raw[_RECORD.size :]).decode())

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, "?")


class SessionOwners:
    """Thread-safe; ``check`` is a dict read. Records are synced before ``put`` returns."""

    def __init__(self, wal: TokenLog, node: str, refused: Callable[[str], None],
                 serving: Callable[[], bool] | None = None) -> None:
        self._wal = wal
        self.node = node
        self._refused = refused
        self._serving = serving  # cluster mode: no session write before the node caught up with etcd
        self._db = wal.env.open_db(b"owners")
        self._lock = threading.Lock()
        self._records: dict[bytes, Ownership] = {}
        # sid -> the FENCED version etcd said its target adopted: its log may idle out (a later fence here is not released)
        self._released: dict[bytes, int] = {}
        self._stripes = [threading.Lock() for _ in range(64)]  # a session's writes against its fence, not one lock for all
        with wal.env.begin(db=self._db) as txn:
            for sid, raw in txn.cursor():
                self._records[bytes(sid)] = Ownership.unpack(bytes(raw))

    def get(self, namespace_id: bytes, session_id: str) -> Ownership | None:
        return self._records.get(TokenLog._sid(namespace_id, session_id))

    def put(self, namespace_id: bytes, session_id: str, record: Ownership, logged: bool = False) -> None:
        """Also starts the session's idle time again (--session-idle-s): while a migration is
        undecided its writes are refused, so the time they could not append does not count
        (``kept``). ``logged``: InvalidRequest, nothing written, unless it has a log here."""
        sid = TokenLog._sid(namespace_id, session_id)
        with self._lock, self._wal.env.begin(write=True) as txn:
            if not self._wal.touch(txn, sid) and logged:
                raise InvalidRequest(f"no session {session_id!r} of this namespace at node {self.node}")
            txn.put(sid, record.pack(), db=self._db)
            self._records[sid] = record
        self._wal.env.sync(True)

    def kept(self, sid: bytes) -> bool:
        """The session's log (by its key) stays however long it idles (session_expiry.py): its
        migration is undecided, or it was fenced here and the target has not adopted it yet
        (until then this log is the only full copy: a migration resumed later needs it)."""
        record = self._records.get(sid)
        return record is not None and (record.state in (FREEZING, INCOMING) or (record.state == FENCED and
                                                                                self._released.get(sid) != record.version))

    def fenced(self) -> list[tuple[bytes, str, Ownership]]:
        """The sessions fenced here whose target was not yet seen adopting them."""
        return [item for item in self.items() if item[2].state == FENCED
                and self._released.get(TokenLog._sid(item[0], item[1])) != item[2].version]

    def release(self, namespace_id: bytes, session_id: str, version: int) -> None:
        """The target adopted ``version`` of the session fenced here: its log may idle out while it
        stays fenced at that version (not kept across a restart: the next sweep reads etcd again)."""
        self._released[TokenLog._sid(namespace_id, session_id)] = version

    def drop(self, namespace_id: bytes, session_id: str) -> None:
        sid = TokenLog._sid(namespace_id, session_id)
        with self._lock, self._wal.env.begin(write=True) as txn:
            txn.delete(sid, db=self._db)
            self._records.pop(sid, None)
        self._wal.env.sync(True)

    def items(self) -> list[tuple[bytes, str, Ownership]]:
        """(namespace, session id, record) of every record here."""
        return [(sid[:NAMESPACE_ID_BYTES], sid[NAMESPACE_ID_BYTES:-1].decode(), rec) for sid, rec in list(self._records.items())]

    @contextmanager
    def writing(self, namespace_id: bytes, session_id: str, call: str | None = None) -> Iterator[None]:
        """Holds the session's stripe over a write (``call``: checked first), so that a fence
        (FREEZING written inside it) falls before or after the write, never between its check and it."""
        sid = TokenLog._sid(namespace_id, session_id)
        with self._stripes[hash(sid) % len(self._stripes)]:
            if call is not None:
                self.check(namespace_id, session_id, call)
            yield

    def check(self, namespace_id: bytes, session_id: str, call: str) -> None:
        """Raises (counted under ``call``) unless this node may write the session: SessionFenced once it is
        FENCED, for good; TierUnavailable ("retry") while a fence or an adoption is undecided (FREEZING,
        INCOMING): etcd may still decide for this node, and a writer that took "being fenced" as final stopped
        a session that then stayed here."""
        if self._serving is not None and not self._serving():
            raise TierUnavailable(f"node {self.node} has not caught up with the cluster (a session may have moved "
                                  "meanwhile): retry")
        record = self.get(namespace_id, session_id)
        if record is None or record.state == OWNED:
            return
        self._refused(call)
        if record.state == FENCED:
            raise SessionFenced(f"session {session_id!r} at node {self.node} is fenced: version {record.version} "
                                f"of the session is owned by node {record.node}")
        if record.state == FREEZING:
            why = f"being fenced (version {record.version + 1} is going to node {record.node}, not decided yet)"
        else:
            why = f"being copied here by a migration from node {record.node}; it is not owned here until adopted"
        raise TierUnavailable(f"session {session_id!r} at node {self.node} is {why}: retry")
