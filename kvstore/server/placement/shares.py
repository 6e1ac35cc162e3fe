"""What the mover asks before a page goes to the ssd tier: whether the share its namespace counts
against takes it (bytes held there and a share of the write budget; implemented in
kvstore/server/tenancy/ssd_share.py, None without shares). Asked by namespace only: whose share it
is and how a refusal is worded are the implementer's. Every call is made with the core's lock held,
so a decision and the page it admits are counted together: concurrent writes cannot pass a share."""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol


class NamespaceShares(Protocol):
    """Each method answers for the share a namespace's pages count against; a namespace that counts
    against none (an unbound one) is refused nothing and counted nowhere."""

    def write_refused(self, namespace_id: bytes, cost: int, tier: str) -> str | None:
        """None when its write-budget share covers ``cost`` device bytes of ``tier`` (nothing taken);
        else the refusal, counted, and why."""
        ...

    def over(self, namespace_id: bytes, num_bytes: int) -> bool:
        """Whether ``num_bytes`` more (pages held + being written) would pass its share's bytes."""
        ...

    def own(self, namespace_id: bytes, pinned: Container[bytes]) -> Container[bytes]:
        """The keys an eviction for its share passes over: pinned ones and those of other shares."""
        ...

    def full(self, namespace_id: bytes, tier: str) -> str:
        """Its share's bytes are full and none of its pages in ``tier`` can go: the refusal, counted, and why."""
        ...

    def placing(self, key: bytes, namespace_id: bytes, cost: int, num_bytes: int) -> None:
        """A page of the namespace is being written: ``cost`` taken from its write share, its
        ``num_bytes`` counted until ``placed``."""
        ...

    def placed(self, key: bytes) -> None:
        """The write of ``key`` ended: published (counted by the directory) or given up."""
        ...
