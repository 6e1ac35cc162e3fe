"""Tenant salts shared by the nodes of a cluster, through etcd (DESIGN §11-12).

A tenant's namespace ids fold in its salt, so every node must use the same one: a node that
meets a tenant without a salt in memory creates it in etcd with a transaction that succeeds
only while the key is absent (``create_revision == 0``), and otherwise reads the one that is
there, so nodes racing for one tenant agree on the first writer's salt. Salts are cached
in memory for the life of the process (a salt never changes). etcd then holds every
tenant's secret: it must be reachable by the nodes only (see the README).

Migration: a node proposes the salt its local ``DATA_DIR/tenant-salts.json`` holds (a file
copied by hand before salts were shared), so an existing cluster keeps its namespace ids; the
local file is read, never written, in cluster mode (it stays the single-node store).

Synchronous (a plain gRPC channel, etcd's own stubs from ``aetcd``): salts are asked for at
start, on SIGHUP and in the authenticating interceptor, all in plain threads, before and
beside the cluster runtime's event loop.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc
from aetcd import rpc

from kvstore.errors import ConfigError, TierUnavailable
from kvstore.security.salts import SALT_BYTES, TenantSalts

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0  # per etcd call; waits that long for an etcd that is starting


class EtcdSalts(TenantSalts):
    """The cluster's tenant salts; the same interface as the single node's ``TenantSalts``."""

    def __init__(self, data_dir: Path, endpoints: Sequence[str], cluster: str, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        super().__init__(data_dir)
        self._local, self._salts = self._salts, {}  # the local file's salts are only proposals here
        self._prefix = f"/kvstore/{cluster}/tenant-salts/".encode()
        target = endpoints[0] if len(endpoints) == 1 else "ipv4:" + ",".join(endpoints)
        self._channel = grpc.insecure_channel(target)
        self._kv = rpc.KVStub(self._channel)
        self._timeout_s = call_timeout_s

    def close(self) -> None:
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
        etcd does not answer (the server does not start, a reload is refused)."""
        with self._lock:
            missing = sorted(set(tenants) - set(self._salts))
            got = {t: self._create_or_read(t) for t in missing}
            self._salts = {**self._salts, **got}  # a new dict: ``salt`` reads without the lock

    def _create_or_read(self, tenant: str) -> bytes:
        key = self._prefix + tenant.encode()
        proposal = self._local.get(tenant) or secrets.token_bytes(SALT_BYTES)
        request = rpc.TxnRequest(
            compare=[rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=key, create_revision=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=proposal.hex().encode()))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))])
        try:
            answer = self._kv.Txn(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise ConfigError(f"etcd did not answer for tenant {tenant!r}'s salt ({exc.code().name}); "  # type: ignore[attr-defined]
                              "tenants' salts are kept in etcd in cluster mode") from None
        if answer.succeeded:
            logger.info("assigned a salt to tenant %s in etcd", tenant)
            return proposal
        kvs = answer.responses[0].response_range.kvs
        try:
            salt = bytes.fromhex(kvs[0].value.decode())
            if len(salt) != SALT_BYTES:
                raise ValueError(f"not {SALT_BYTES} bytes")
        except (IndexError, ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"etcd key {key.decode()} does not hold a salt ({exc}); restore it from a backup") from None
        if tenant in self._local and self._local[tenant] != salt:
            logger.warning("tenant %s: the salt in %s differs from the cluster's (etcd); pages cached here under the old "
                           "one are unreachable", tenant, self.path)
        return salt
