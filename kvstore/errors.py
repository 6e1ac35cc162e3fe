"""The error hierarchy shared by client and server.

The servicers map each class to one gRPC status (kvstore/server/services/rpc_errors.py); the client maps
statuses back, so an engine catches the same class whichever side raised it.
"""

from __future__ import annotations

from typing import ClassVar


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class InvalidRequest(KVStoreError):
    """The input is malformed (sizes, counts, key lengths, layouts); nothing was changed."""


class StreamCut(InvalidRequest):
    """A request stream ended inside a page: a client that sent half a page, or (a moment
    before the server sees it) a client that cancelled."""


class NamespaceMismatch(InvalidRequest):
    """A page or request names a namespace or layout that does not match; nothing was changed."""


class StaleIncarnation(KVStoreError):
    """Cluster mode: a call of a node's incarnation (registration epoch) that is over; the
    node registered again since. Not retried: the new incarnation sends what it holds."""


class StaleGeneration(KVStoreError):
    """The call names a namespace generation that is not the namespace's current one (an
    invalidation raised it meanwhile: a late fetch, a lagging node, a writer that computed its
    KV before the invalidation); nothing was changed. ``current``: the namespace's generation
    where it was refused (-1 where the client rebuilt the error: the message names it)."""

    def __init__(self, message: str, current: int = -1) -> None:
        super().__init__(message)
        self.current = current


class SessionFenced(KVStoreError):
    """A write (append, save) to a session this node no longer owns: a live migration fenced
    it (DESIGN §12.8; the message names the version and the owner), or is fencing it now. Nothing
    was written; the session continues at its owner."""


class CannotConverge(KVStoreError):
    """A live migration gave up before its fence: the session grew at least as fast as it was
    copied, round after round. Nothing was fenced; the source keeps the session."""


class TierFull(KVStoreError):
    """No room in the tier, even after eviction (everything left is leased); nothing was stored."""


class MetadataFull(TierFull):
    """An LMDB map (directory, token log or ssd index) has no room left. The transaction
    was aborted and memory left as it was: nothing of the request was stored. The message
    names the map and the flag that makes it larger."""


class LimitExceeded(KVStoreError):
    """A bound of the server's own is reached (streams open at once, remote records); nothing
    was changed. Retry later, or make room (close streams, remove records)."""


class QuotaExceeded(LimitExceeded):
    """A tenant's call would pass one of its quotas (DESIGN §11). Its figures are fields, sent
    to the client beside the message (status.error_label), so that neither side reads them
    from text: ``quota`` (host_bytes, leases, ...), ``held`` (what the tenant holds), ``wanted``
    (what the call asked for), ``limit``, and ``freed``: bytes of its own pages the server wrote
    down trying to make room before it refused (0: nothing was done)."""

    FIELDS: ClassVar[dict[str, type]] = {"tenant": str, "quota": str, "held": int, "wanted": int, "limit": int, "freed": int}

    def __init__(self, tenant: str, quota: str, held: int, wanted: int, limit: int, freed: int = 0) -> None:
        self.tenant, self.quota, self.held, self.wanted, self.limit, self.freed = tenant, quota, held, wanted, limit, freed
        name = quota.replace("_", " ")
        done = (f"{freed} bytes of its own pages were written down to make room (to a lower tier; dropped where there "
                "is none); no allocation was made" if freed > 0 else "nothing was done")
        super().__init__(f"tenant {tenant!r} holds {held} {name}; {wanted} more would pass its quota of {limit} "
                         f"(--tenant-{quota.replace('_', '-')} or the auth file's quotas); {done}")

    def fields(self) -> dict[str, str | int]:
        return {name: getattr(self, name) for name in self.FIELDS}

    def after_freeing(self, freed: int) -> QuotaExceeded:
        """The same refusal, told that ``freed`` bytes went down first (the servicer's passes)."""
        return QuotaExceeded(self.tenant, self.quota, self.held, self.wanted, self.limit, max(0, freed))


class HostQuotaFull(QuotaExceeded):
    """The host_bytes quota's refusal before the servicer made room: ``keep_bytes``, how much of
    its own the tenant may keep in the host tier for the request to fit (the servicer evicts its
    coldest pages down to that, then asks again). Never sent: the caller gets a QuotaExceeded."""

    def __init__(self, refused: QuotaExceeded, keep_bytes: int) -> None:
        super().__init__(*(getattr(refused, name) for name in QuotaExceeded.FIELDS))
        self.keep_bytes = keep_bytes


class PageMissing(KVStoreError):
    """A page promised by a lookup is gone (evicted, invalidated, or its bytes were lost)."""


class PageCorrupt(KVStoreError):
    """A page failed its length or checksum check; it was quarantined and not returned."""


class LeaseExpired(KVStoreError):
    """The lease or allocation was released or timed out before it was used."""


class TierUnavailable(KVStoreError):
    """A tier cannot work here (no CUDA for hbm, an unusable --ssd-dir)."""


class Unauthenticated(KVStoreError):
    """The caller presented no credential, or one the server does not accept (unknown,
    expired or revoked token; a client certificate no entry names); nothing was done."""


class PermissionDenied(KVStoreError):
    """The caller is authenticated but lacks the right (read, write, admin) or the
    ownership the request needs; nothing was changed."""


class ConfigError(KVStoreError):
    """A configuration value is invalid; the message names the flag that fixes it."""
