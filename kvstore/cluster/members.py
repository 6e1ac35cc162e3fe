"""What cluster membership is made of: a node's record, its state, and the membership
configuration. Plain values; ``membership.py`` keeps them in etcd."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstore.errors import ConfigError, InvalidRequest


class MemberState(enum.Enum):
    JOINING = "joining"
    MEMBER = "member"
    LOST = "lost"
    CLOSED = "closed"


@dataclass(frozen=True)
class Member:
    """One node as registered: where to reach it and what it holds. ``epoch`` grows with
    every registration of the node id, so a record published under an older epoch is stale."""

    node_id: str
    grpc_address: str
    data_address: str
    tiers: tuple[str, ...] = ()
    capacities: Mapping[str, int] = field(default_factory=dict)
    epoch: int = 0
    ttl_s: int = 0  # its lease TTL (--cluster-ttl): an issuer fencing it waits this out (0: not said)

    def to_json(self) -> bytes:
        return json.dumps({"node_id": self.node_id, "grpc_address": self.grpc_address, "data_address": self.data_address,
                           "tiers": list(self.tiers), "capacities": dict(self.capacities), "epoch": self.epoch,
                           "ttl_s": self.ttl_s}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Member:
        """Parses a node record; raises InvalidRequest for one that is not a Member."""
        try:
            doc = json.loads(raw)
            member = cls(str(doc["node_id"]), str(doc["grpc_address"]), str(doc["data_address"]),
                         tuple(str(t) for t in doc["tiers"]), {str(k): int(v) for k, v in doc["capacities"].items()},
                         int(doc["epoch"]), int(doc.get("ttl_s", 0)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidRequest(f"bad member record: {exc!r}") from exc
        return member


@dataclass(frozen=True)
class MembershipConfig:
    cluster: str
    node_id: str
    ttl_s: int = 10
    keepalive_s: float = 0.0  # 0: ttl_s / 3
    retry_s: float = 0.25     # between attempts while etcd does not answer

    def __post_init__(self) -> None:
        for name, value in (("--cluster-name", self.cluster), ("--node-id", self.node_id)):
            if not value or "/" in value or not value.isprintable():
                raise ConfigError(f"{name} must be a non-empty printable name without '/', got {value!r}")
        if self.ttl_s < 2:
            raise ConfigError("--cluster-ttl must be >= 2 s (etcd's shortest lease)")
        if self.keepalive_s < 0 or self.keepalive_s >= self.ttl_s:
            raise ConfigError("--cluster-keepalive must be in [0, ttl)")

    @property
    def root(self) -> bytes:
        return f"/kvstore/{self.cluster}/".encode()

    @property
    def keepalive_every_s(self) -> float:
        return self.keepalive_s or self.ttl_s / 3
