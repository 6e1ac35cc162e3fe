"""Token write-ahead log: per session, the prompt and every token returned to the user.

After a crash of the worker or the server, the log says which sequence to continue and the
KV checkpoint says how much of it must be prefilled again; nothing the user saw is sampled
again. Appends carry the length the writer believes is logged, so a retried append is
applied once. Entries live in LMDB (``data_dir/wal.lmdb``); a ``sync`` append is durable
before it is acknowledged, others are synced with the next sync append (batched).

More: kvstore/server/README.md (### tokenlog.py).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from kvstore.config import TOKEN_LOG_MAP_BYTES
from kvstore.errors import InvalidRequest
from kvstore.lmdb_env import map_full, open_env
from kvstore.types import NAMESPACE_ID_BYTES

logger = logging.getLogger(__name__)

_META = struct.Struct("<IQd")  # prompt tokens, total length, last append (unix time)
_META_UNTIMED = struct.Struct("<IQ")  # the older format: prompt tokens, total length
MAX_SESSION_ID = 256


def _unpack(raw: bytes, opened_at: float) -> tuple[int, int, float]:
    """A meta record, either format: (prompt tokens, length, last append)."""
    if len(raw) == _META_UNTIMED.size:
        return (*_META_UNTIMED.unpack(raw), opened_at)
    return _META.unpack(raw)


class TokenLog:
    def __init__(self, data_dir: Path, map_bytes: int = TOKEN_LOG_MAP_BYTES, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.env = open_env(data_dir / "wal.lmdb", map_bytes, max_dbs=3, sync=False, metasync=False)
        self.meta_db = self.env.open_db(b"meta")
        self.chunks_db = self.env.open_db(b"chunks")
        self.monotonic = monotonic
        self.opened_at = clock()  # the wall clock, read once: only a restart reads it again
        self._opened_mono = monotonic()
        self._lock = threading.Lock()
        self._tokens: Counter[bytes] = Counter()  # namespace -> tokens logged in its sessions (tenant quotas)
        untimed = []
        with self.env.begin(db=self.meta_db) as txn:
            for sid, raw in txn.cursor():
                self._tokens[bytes(sid[:NAMESPACE_ID_BYTES])] += _unpack(raw, self.opened_at)[1]
                if len(raw) == _META_UNTIMED.size:
                    untimed.append((bytes(sid), bytes(raw)))
        if untimed:  # the older format: appended now, once (else every restart would count as an append)
            try:
                with self.env.begin(write=True) as txn:
                    for sid, raw in untimed:
                        txn.put(sid, _META.pack(*_META_UNTIMED.unpack(raw), self.opened_at), db=self.meta_db)
                self.env.sync(True)
            except lmdb.MapFullError:
                logger.warning("the token log is full: %d sessions of the older format keep counting as appended at "
                               "each opening", len(untimed))

    def now(self) -> float:
        """The time appends are stamped with and idle times measured on (the module docstring)."""
        return self.opened_at + (self.monotonic() - self._opened_mono)

    def _last_append(self, raw: bytes, now: float) -> float:
        last = _unpack(raw, self.opened_at)[2]
        return last if last <= now else self.opened_at  # ahead of now: written before the clock was set back

    def tokens_of(self, namespace_id: bytes) -> int:
        """Tokens logged in the namespace's open sessions."""
        return self._tokens.get(namespace_id, 0)

    @staticmethod
    def _sid(namespace_id: bytes, session_id: str) -> bytes:
        raw = session_id.encode()
        if not raw or len(raw) > MAX_SESSION_ID or b"\0" in raw:
            raise InvalidRequest(f"session_id must be 1..{MAX_SESSION_ID} bytes without NUL")
        return namespace_id + raw + b"\0"

    def append(self, namespace_id: bytes, session_id: str, expected_length: int, tokens: list[int],
               prompt_tokens: int = 0, sync: bool = True, charge: Callable[[int], None] | None = None) -> int:
        """Appends unless already applied; returns the logged length. A gap is an error.
        ``charge`` is called, under the log's lock, with the number of tokens the append adds
        (not with a retry's): it may refuse (raise), and nothing is written then."""
        sid = self._sid(namespace_id, session_id)
        with self._lock, map_full(self.env, "the token log"), self.env.begin(write=True) as txn:
            raw = txn.get(sid, db=self.meta_db)
            prompt, length, _ = _unpack(raw, self.opened_at) if raw else (prompt_tokens, 0, 0.0)
            if expected_length + len(tokens) <= length:
                # A retry repeats what is logged there; other tokens are another writer's, not ours to ack.
                if self._logged(txn, sid, length)[expected_length : expected_length + len(tokens)] != list(tokens):
                    raise InvalidRequest(f"session {session_id!r}: the append at {expected_length} conflicts with the "
                                         "tokens logged there (another writer?)")
                return length
            if expected_length != length and raw is None:
                raise InvalidRequest(f"session {session_id!r} has no log here (never appended to, or ended: EndSession, or "
                                     f"idle past --session-idle-s), the append expects {expected_length} tokens logged")
            if expected_length != length:
                raise InvalidRequest(f"session {session_id!r} has {length} tokens logged, the append expects {expected_length}")
            if charge is not None:
                charge(len(tokens))
            if tokens:
                txn.put(sid + struct.pack(">Q", length), np.asarray(tokens, dtype="<u4").tobytes(), db=self.chunks_db)
            length += len(tokens)
            txn.put(sid, _META.pack(prompt, length, self.now()), db=self.meta_db)
        with self._lock:  # counted once the transaction committed
            self._tokens[namespace_id] += len(tokens)
        if sync:
            self.env.sync(True)
        return length

    def has(self, namespace_id: bytes, session_id: str) -> bool:
        """Whether the session has a log here (one read of its record, not of its tokens)."""
        with self.env.begin() as txn:
            return txn.get(self._sid(namespace_id, session_id), db=self.meta_db) is not None

    def read(self, namespace_id: bytes, session_id: str) -> tuple[int, list[int]] | None:
        sid = self._sid(namespace_id, session_id)
        with self.env.begin() as txn:
            raw = txn.get(sid, db=self.meta_db)
            if raw is None:
                return None
            prompt, length, _ = _unpack(raw, self.opened_at)
            return prompt, self._logged(txn, sid, length)

    def _logged(self, txn: Any, sid: bytes, length: int) -> list[int]:
        parts = []
        cursor = txn.cursor(db=self.chunks_db)
        if cursor.set_range(sid):
            for key, value in cursor:
                if not bytes(key).startswith(sid):
                    break
                parts.append(np.frombuffer(bytes(value), dtype="<u4"))
        tokens: list[int] = np.concatenate(parts).tolist() if parts else []
        return tokens[:length]

    def end(self, namespace_id: bytes, session_id: str) -> None:
        sid = self._sid(namespace_id, session_id)
        with self._lock, map_full(self.env, "the token log"), self.env.begin(write=True) as txn:
            removed = self._end(txn, sid)
        self._uncount(sid, removed)
        self.env.sync(True)

    def touch(self, txn: Any, sid: bytes) -> bool:
        """In a write transaction of this log's env: the session's idle time starts again now
        (its owner changed, session_owners.py); False when it has no log here."""
        raw = txn.get(sid, db=self.meta_db)
        if raw is None:
            return False
        prompt, length, _ = _unpack(raw, self.opened_at)
        txn.put(sid, _META.pack(prompt, length, self.now()), db=self.meta_db)
        return True

    def expire_idle(self, idle_s: float, keep: Callable[[bytes], bool] = lambda sid: False) -> int:
        """Ends every session nothing was appended to for ``idle_s`` but those ``keep`` names
        (by their key: namespace, id, NUL); returns how many. Each is checked again in the
        transaction that ends it: an append meanwhile keeps it."""
        now = self.now()
        before = now - idle_s
        with self.env.begin(db=self.meta_db) as txn:
            idle = [bytes(sid) for sid, raw in txn.cursor() if self._last_append(raw, now) <= before]
        ended, failed = 0, []
        for sid in idle:
            removed = None
            try:
                with self._lock, map_full(self.env, "the token log"), self.env.begin(write=True) as txn:
                    raw = txn.get(sid, db=self.meta_db)
                    if raw is not None and self._last_append(raw, now) <= before and not keep(sid):
                        removed = self._end(txn, sid)
            except Exception as exc:  # noqa: BLE001 - one that cannot end now (a full map) holds up no other
                failed.append(exc)
                continue
            if removed is not None:
                self._uncount(sid, removed)
                ended += 1
        if ended:
            self.env.sync(True)
        if failed:
            logger.warning("%d idle session(s) could not be ended now, tried again at the next sweep: %r", len(failed), failed[0])
        return ended

    def _end(self, txn: Any, sid: bytes) -> int:
        """Deletes the session's records in ``txn`` (the log's lock held); the tokens it held."""
        raw = txn.get(sid, db=self.meta_db)
        txn.delete(sid, db=self.meta_db)
        cursor = txn.cursor(db=self.chunks_db)
        if cursor.set_range(sid):
            while bytes(cursor.key()).startswith(sid):
                if not cursor.delete():
                    break
        return _unpack(raw, self.opened_at)[1] if raw is not None else 0

    def _uncount(self, sid: bytes, tokens: int) -> None:
        """Once the transaction that ended the session committed: its tokens stop counting."""
        with self._lock:
            self._tokens[sid[:NAMESPACE_ID_BYTES]] -= tokens

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
