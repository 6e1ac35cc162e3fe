"""What the mover asks before a page of a tenant goes to the ssd tier: the tenant's ssd_bytes
share and its share of the write budget (implemented in kvstore/server/tenancy/ssd_share.py;
None on a server without tenants). Every call is made with the core's lock held, so a
decision and the page it admits are counted together: concurrent writes of one tenant
cannot pass its share."""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol


class TenantShares(Protocol):
    def tenant_of(self, namespace_id: bytes) -> str | None:
        """The tenant whose share a page of the namespace counts against (None: no share)."""
        ...

    def over(self, tenant: str, num_bytes: int) -> bool:
        """Whether ``num_bytes`` more (pages held + being written) would pass its ssd_bytes."""
        ...

    def own(self, tenant: str, pinned: Container[bytes]) -> Container[bytes]:
        """The keys an eviction for ``tenant`` passes over: pinned ones and other tenants'."""
        ...

    def can_write(self, tenant: str, cost: int) -> bool:
        """Whether its write-budget share covers ``cost`` device bytes (nothing taken)."""
        ...

    def wrote(self, tenant: str, cost: int) -> None:
        """Takes ``cost`` from its write-budget share (checked with ``can_write``)."""
        ...

    def placing(self, key: bytes, tenant: str, num_bytes: int) -> None:
        """A page of ``tenant`` is being written: counted until ``placed``."""
        ...

    def placed(self, key: bytes) -> None:
        """The write of ``key`` ended: published (counted by the directory) or given up."""
        ...

    def refused(self, tenant: str, quota: str) -> None: ...
