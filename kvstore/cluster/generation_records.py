"""The cluster's copy of each namespace's generation, in etcd (DESIGN §12.4).

More: kvstore/cluster/README.md (### generation_records.py).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import Callable

from kvstore.cluster.etcd import EtcdClient, KeyValue
from kvstore.errors import LimitExceeded
from kvstore.types import MAX_GENERATION

logger = logging.getLogger(__name__)

_CAS_ROUNDS = 64  # a compare-and-swap lost this often in a row: something else is wrong
# the young key's lease, out only after ten years (then made again): a key gone with a shorter lease would
# leave a backup restored later without one, its age unknown (DESIGN §12.4)
YOUNG_S = 10 * 365 * 86400


class EtcdGenerations:
    def __init__(self, etcd: EtcdClient, root: bytes, node: str) -> None:
        self._etcd = etcd
        self.prefix = root + b"generations/"
        self._incarnation_key = root + b"incarnation"
        self._young_key = root + b"incarnation-young"  # under a lease of YOUNG_S, made with the incarnation
        self.fenced_prefix = root + b"fenced/"
        self.caught_up_prefix = root + b"caught-up/"
        self._node = node

    async def incarnation(self) -> tuple[bytes, float]:
        """This etcd's incarnation id (made now if it has none: a new or wiped etcd) and how long
        ago, at least, it was made or etcd last started, by etcd's clock: the time its young key's
        lease has run (no node's clock is trusted). etcd renews every lease it holds to its whole
        TTL when it starts, so a restart or a restore from a backup makes it young again. A young
        key lacking (an older kvstore made the incarnation) is made now: young from here."""
        for _ in range(_CAS_ROUNDS):
            kv = await self._etcd.get(self._incarnation_key)
            young = await self._etcd.get(self._young_key)
            if kv is not None and (age := await self._age(young)) is not None:
                return kv.value.partition(b" ")[0], age
            lease, _ = await self._etcd.grant(YOUNG_S)  # before the key: every node of a replaced etcd stopped before
            if kv is None:
                made = f"{secrets.token_hex(16)} {time.time():.3f}".encode()
                puts, expected = [(self._incarnation_key, made, 0), (self._young_key, made, lease)], {self._incarnation_key: 0}
            else:
                made = kv.value
                puts = [(self._young_key, made, lease)]
                expected = {self._incarnation_key: kv.mod_revision, self._young_key: young.mod_revision if young else 0}
            if await self._etcd.put_if(puts, expected):
                return made.partition(b" ")[0], 0.0
            await self._etcd.revoke(lease)
        raise RuntimeError(f"{self._incarnation_key!r}: {_CAS_ROUNDS} creations lost in a row")

    async def _age(self, young: KeyValue | None) -> float | None:
        """The time the young key's lease has run; None without one."""
        if young is None or not young.lease:
            return None
        granted, left = await self._etcd.lease_ttl(young.lease)
        if left < 0:
            return None
        return max(0.0, granted - left - 1.0)  # etcd rounds what is left down

    async def note_fenced(self, node: str, lease: int, serves_s: float) -> int:
        """Before ``node``'s ``lease`` is revoked: a record that lives in etcd (by its clock) at
        least as long as ``node`` may still serve, ``serves_s`` from the revoke, for an issuer
        that never listed ``node`` (``fenced``). The revoke may land up to three calls (this grant,
        the put, the revoke) after this lease's grant: that long more, until ``fence_settled``.
        One record per lease: a later fencing of a shorter TTL does not shorten an earlier one's.
        Returns the record's own lease."""
        own, _ = await self._etcd.grant(math.ceil(serves_s + 3 * self._etcd.call_timeout_s) + 1)
        await self._etcd.put(self._fenced_key(node, lease), b"", own)
        return own

    async def fence_settled(self, node: str, lease: int, serves_s: float, noted: int) -> None:
        """The revoke of ``node``'s ``lease`` was acknowledged: its record from now on lives
        ``serves_s`` (and etcd's rounding) past now, under a lease granted after that
        acknowledgement, instead of the margin ``note_fenced`` gave for a revoke yet to land.
        Best effort: a record left as noted is longer, never shorter."""
        own, _ = await self._etcd.grant(math.ceil(serves_s) + 1)
        await self._etcd.put(self._fenced_key(node, lease), b"", own)
        await self._etcd.revoke(noted)  # the noted lease holds no key any more

    def _fenced_key(self, node: str, lease: int) -> bytes:
        return self.fenced_prefix + f"{node}/{lease:x}".encode()

    async def fenced(self) -> list[float]:
        """For each record of ``note_fenced`` still in etcd: seconds it has left, at most."""
        _, kvs = await self._etcd.get_prefix(self.fenced_prefix)
        lefts = [(await self._etcd.lease_ttl(kv.lease))[1] for kv in kvs if kv.lease]
        return [left + 1.0 for left in lefts if left >= 0]

    def _key(self, namespace_id: bytes) -> bytes:
        return self.prefix + namespace_id.hex().encode()

    def parse(self, kv: KeyValue) -> tuple[bytes, int] | None:
        """(namespace, generation) of a key under the prefix; None (logged) for one that is not."""
        try:
            namespace_id = bytes.fromhex(kv.key[len(self.prefix):].decode())
            generation = int(json.loads(kv.value)["generation"])
            if len(namespace_id) != 16 or not 0 <= generation <= MAX_GENERATION:  # one entered with many: all or none
                raise ValueError(f"namespace of {len(namespace_id)} bytes, generation {generation}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            logger.warning("ignoring generation record %r: %r", kv.key, exc)
            return None
        return namespace_id, generation

    async def caught_up(self) -> dict[str, bytes]:
        """node -> the incarnation id it last caught up with (written back what it knew)."""
        _, kvs = await self._etcd.get_prefix(self.caught_up_prefix)
        return {kv.key[len(self.caught_up_prefix):].decode(errors="replace"): kv.value for kv in kvs}

    async def read_all(self) -> tuple[int, dict[bytes, int]]:
        """(etcd's revision, every namespace's generation) as etcd holds them now."""
        revision, kvs = await self._etcd.get_prefix(self.prefix)
        out: dict[bytes, int] = {}
        for kv in kvs:
            parsed = self.parse(kv)
            if parsed is not None:
                out[parsed[0]] = parsed[1]
        return revision, out

    async def raise_above(self, namespace_id: bytes, above: int) -> int:
        """Writes a generation above both etcd's and ``above`` (this node's); returns it.
        LimitExceeded at MAX_GENERATION (a namespace that high is used up: use another)."""
        def higher(current: int) -> int:
            if max(current, above) >= MAX_GENERATION:
                raise LimitExceeded(f"namespace {namespace_id.hex()} is at the highest generation; use another namespace")
            return max(current, above) + 1
        return await self._swap(namespace_id, higher)

    async def seed(self, namespace_id: bytes, generation: int) -> bool:
        """Writes ``generation`` where etcd holds none or a lower one; True when it wrote."""
        return await self._swap(namespace_id, lambda current: generation if current < generation else None) is not None

    async def _swap(self, namespace_id: bytes, change: Callable[[int], int | None]) -> int | None:
        key = self._key(namespace_id)
        for _ in range(_CAS_ROUNDS):
            kv = await self._etcd.get(key)
            parsed = self.parse(kv) if kv is not None else None
            wanted = change(parsed[1] if parsed is not None else 0)
            if wanted is None:
                return None
            doc = {"generation": wanted, "issued_by": self._node, "issued_at_s": time.time()}
            if await self._etcd.put_if([(key, json.dumps(doc).encode(), 0)], {key: kv.mod_revision if kv else 0}):
                return int(wanted)
        raise RuntimeError(f"generation of namespace {namespace_id.hex()}: {_CAS_ROUNDS} compare-and-swaps lost in a row")
