"""The cluster's record of who owns each migrated session, in etcd (DESIGN §12.8).

    <root>sessions/<ns hex>/<session id hex>   JSON {"version": v, "owner": node, "issued_by", "issued_at_s",
                                               "adopted": true once the owner adopted v}

More: kvstore/cluster/README.md (### session_records.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from kvstore.cluster.etcd import EtcdClient, KeyValue

logger = logging.getLogger(__name__)

_CAS_ROUNDS = 64


@dataclass(frozen=True)
class SessionRecord:
    version: int
    owner: str
    adopted: bool = False


class EtcdSessions:
    def __init__(self, etcd: EtcdClient, root: bytes, node: str) -> None:
        self._etcd = etcd
        self.prefix = root + b"sessions/"
        self._node = node

    def _key(self, namespace_id: bytes, session_id: str) -> bytes:
        return self.prefix + namespace_id.hex().encode() + b"/" + session_id.encode().hex().encode()

    def parse(self, kv: KeyValue) -> tuple[bytes, str, SessionRecord] | None:
        """(namespace, session id, record) of a key under the prefix; None (logged) for one that is not."""
        try:
            ns_hex, _, sid_hex = kv.key[len(self.prefix):].decode().partition("/")
            doc = json.loads(kv.value)
            record = SessionRecord(int(doc["version"]), str(doc["owner"]), doc.get("adopted") is True)
            return bytes.fromhex(ns_hex), bytes.fromhex(sid_hex).decode(), record
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            logger.warning("ignoring session record %r: %r", kv.key, exc)
            return None

    async def read(self, namespace_id: bytes, session_id: str) -> SessionRecord | None:
        kv = await self._etcd.get(self._key(namespace_id, session_id))
        parsed = self.parse(kv) if kv is not None else None
        return parsed[2] if parsed is not None else None

    async def read_all(self) -> list[tuple[bytes, str, SessionRecord]]:
        _, kvs = await self._etcd.get_prefix(self.prefix)
        return [parsed for kv in kvs if (parsed := self.parse(kv)) is not None]

    async def decide(self, namespace_id: bytes, session_id: str, version: int, owner: str) -> SessionRecord:
        """Writes ``version`` for ``owner`` if etcd holds ``version - 1`` or less; answers the
        record etcd holds afterwards (another owner's, or a higher version: this one lost).
        A node writing back a record it knows (``seed``, etcd lacks it or holds less) is the same call."""
        key = self._key(namespace_id, session_id)
        for _ in range(_CAS_ROUNDS):
            kv = await self._etcd.get(key)
            parsed = self.parse(kv) if kv is not None else None
            held = parsed[2] if parsed is not None else SessionRecord(0, "")
            if held.version >= version:
                return held
            doc = {"version": version, "owner": owner, "issued_by": self._node, "issued_at_s": time.time()}
            if await self._etcd.put_if([(key, json.dumps(doc).encode(), 0)], {key: kv.mod_revision if kv else 0}):
                return SessionRecord(version, owner)
        raise RuntimeError(f"session {session_id!r}: {_CAS_ROUNDS} compare-and-swaps lost in a row")

    async def adopt(self, namespace_id: bytes, session_id: str, version: int, owner: str) -> SessionRecord:
        """Marks ``version`` (decided for ``owner``) adopted; answers the record etcd holds
        afterwards (unchanged when it holds another version or owner)."""
        key = self._key(namespace_id, session_id)
        for _ in range(_CAS_ROUNDS):
            kv = await self._etcd.get(key)
            parsed = self.parse(kv) if kv is not None else None
            if kv is None or parsed is None or parsed[2] != SessionRecord(version, owner):
                return parsed[2] if parsed is not None else SessionRecord(0, "")
            doc = {**json.loads(kv.value), "adopted": True}
            if await self._etcd.put_if([(key, json.dumps(doc).encode(), 0)], {key: kv.mod_revision}):
                return SessionRecord(version, owner, True)
        raise RuntimeError(f"session {session_id!r}: {_CAS_ROUNDS} compare-and-swaps lost in a row")
