"""Tenant salts shared by the nodes of a cluster, through etcd (DESIGN §11-12).

A tenant's namespace ids fold in its salt, so every node must use the same one: a node that
meets a tenant without a salt in memory creates it in etcd with a transaction that succeeds
only while the key is absent (``create_revision == 0``), and otherwise reads the one that is
there, so nodes racing for one tenant agree on the first writer's salt. etcd then holds every
tenant's secret: it must be reachable by the nodes only (see the README).

More: kvstore/cluster/README.md (### salt_records.py).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
from aetcd import rpc

from kvstore.cluster.cluster_errors import CoordinatorUnavailable
from kvstore.cluster.etcd import MAX_RECEIVE_BYTES, PAGE_KEYS
from kvstore.errors import ConfigError, TierUnavailable
from kvstore.security.salts import SALT_BYTES, TenantSalts

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0  # per etcd call; waits that long for an etcd that is starting


class EtcdSalts(TenantSalts):
    """The cluster's tenant salts; the same interface as the single node's ``TenantSalts``.

    Thread-safety: ``salt`` reads memory without a lock; ``ensure`` and ``reseed`` take the
    lock, so they run one at a time (etcd calls included: a miss waits for a reseed). A salt
    is in memory only once the local file holds it.
    """

    def __init__(self, data_dir: Path, endpoints: Sequence[str], cluster: str, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        super().__init__(data_dir)
        self._local, self._salts = self._salts, {}  # the file's salts are proposals until etcd agrees
        self._prefix = f"/kvstore/{cluster}/tenant-salts/".encode()
        target = endpoints[0] if len(endpoints) == 1 else "ipv4:" + ",".join(endpoints)
        self._channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)])
        self._kv = rpc.KVStub(self._channel)
        self._timeout_s = call_timeout_s
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def salt(self, tenant: str) -> bytes:
        found = self._salts.get(tenant)
        if found is not None:
            return found
        try:
            self.ensure((tenant,))
        except ConfigError as exc:
            raise TierUnavailable(str(exc)) from None
        return self._salts[tenant]

    def ensure(self, tenants: Iterable[str]) -> None:
        """Gets (creating where absent) the salts of the tenants not cached yet; ConfigError when
        etcd does not answer (the server does not start, a reload is refused), OSError when the
        local file cannot be written (nothing is handed out then)."""
        with self._lock:
            missing = sorted(set(tenants) - set(self._salts))
            try:
                got = {t: self._agree(t, self._local.get(t))[0] for t in missing}
            except CoordinatorUnavailable as exc:
                raise ConfigError(f"{exc}; tenants' salts are kept in etcd in cluster mode") from None
            self._keep(got)

    def reseed(self) -> list[str]:
        """Proposes every salt this node knows (memory and local file) to etcd again, each
        created only where absent; returns the tenants whose salt it put back, sorted.

        For an etcd that was replaced (wiped, restored from an old snapshot). Idempotent (a
        second call finds them all and returns []), callable from any thread at any time, and
        after ``close`` a no-op. A salt etcd holds differently is adopted, as on a miss.
        Raises CoordinatorUnavailable when etcd does not answer (what was put back stays;
        call again), ConfigError when a key holds no salt, OSError when the file cannot be
        written.
        """
        with self._lock:
            if self._closed:
                return []
            known = {**self._local, **self._salts}  # the same salt where both have one
            present = self._all_in_etcd()
            got: dict[str, bytes] = {}
            recreated: list[str] = []
            for tenant in sorted(known):
                if present.get(tenant) == known[tenant].hex().encode():
                    continue
                got[tenant], created = self._agree(tenant, known[tenant])
                if created:
                    recreated.append(tenant)
            self._keep(got)
        if recreated:
            logger.warning("etcd lacked the salts of tenant(s) %s: put back from this node's copy", ", ".join(recreated))
        return recreated

    def _keep(self, got: dict[str, bytes]) -> None:
        """Writes ``got`` to the local file (where it differs), then publishes it in memory. Under the lock."""
        local = {**self._local, **got}
        if local != self._local:
            self._write(local)
            self._local = local
        if got:
            self._salts = {**self._salts, **got}  # a new dict: ``salt`` reads without the lock

    def _agree(self, tenant: str, proposal: bytes | None) -> tuple[bytes, bool]:
        """The cluster's salt of ``tenant`` and whether this call created it in etcd: ``proposal``
        (else a new one) where etcd has none, else etcd's."""
        key = self._prefix + tenant.encode()
        mine = proposal or secrets.token_bytes(SALT_BYTES)
        request = rpc.TxnRequest(
            compare=[rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=key, create_revision=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=mine.hex().encode()))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))])
        answer = self._call(self._kv.Txn, request, f"tenant {tenant!r}'s salt")
        if answer.succeeded:
            logger.info("assigned a salt to tenant %s in etcd", tenant)
            return mine, True
        kvs = answer.responses[0].response_range.kvs
        salt = self._parse(key, kvs[0].value if kvs else b"")
        if proposal is not None and proposal != salt:
            logger.error("tenant %s: etcd holds a salt other than this node's (%s); the cluster's is kept, so the "
                         "tenant's pages stored here under the old one are unreachable (etcd replaced and the "
                         "tenant met at a node that did not know its salt first?)", tenant, self.path)
        return salt, False

    def _all_in_etcd(self) -> dict[str, bytes]:
        """Every tenant's value in etcd now, unparsed (a damaged key fails only that tenant's
        ``_agree``). Read in pages of PAGE_KEYS at the first page's revision, as ``get_prefix``
        does: one answer for every tenant would pass the channel's receive limit."""
        end, key, revision, out = self._prefix[:-1] + bytes([self._prefix[-1] + 1]), self._prefix, 0, {}
        while True:
            request = rpc.RangeRequest(key=key, range_end=end, limit=PAGE_KEYS, revision=revision)
            answer = self._call(self._kv.Range, request, "the tenants' salts")
            out.update((kv.key[len(self._prefix):].decode(errors="replace"), kv.value) for kv in answer.kvs)
            if not answer.more or not answer.kvs:
                return out
            key, revision = answer.kvs[-1].key + b"\0", revision or answer.header.revision

    @staticmethod
    def _parse(key: bytes, value: bytes) -> bytes:
        try:
            salt = bytes.fromhex(value.decode())
            if len(salt) != SALT_BYTES:
                raise ValueError(f"not {SALT_BYTES} bytes")
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"etcd key {key.decode(errors='replace')} does not hold a salt ({exc}); "
                              "restore it from a backup") from None
        return salt

    def _call(self, method: Callable[..., Any], request: object, what: str) -> Any:  # aetcd's stubs are untyped
        if self._closed:
            raise CoordinatorUnavailable(f"etcd not asked for {what}: the salts are closed")
        try:
            return method(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise CoordinatorUnavailable(f"etcd did not answer for {what} ({exc.code().name})") from None  # type: ignore[attr-defined]
