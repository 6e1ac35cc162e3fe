"""Configuration: one frozen dataclass per component, composed into ServerConfig.

Only ``main()`` reads argv; every component receives its own slice. Validation happens in
``__post_init__`` and the error names the flag that fixes it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.security.exposure import check_exposure
from kvstore.types import LOCAL_TIER_NAMES

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MIN_MAP_BYTES = 64 << 10  # an LMDB map smaller than this cannot hold its own tables
MAX_TTL_S = 600  # --cluster-ttl: a node serves up to this long past its last keep-alive
MAP_BYTES = 8 << 30  # default LMDB map of the directory and of the ssd index (address space, not disk)
TOKEN_LOG_MAP_BYTES = 4 << 30
DEMOTE_SCHEDS = ("idle", "normal")  # --demote-sched: the background demoter in Linux's SCHED_IDLE class, or normal at --demote-nice


def parse_size(text: str | int, flag: str = "size") -> int:
    """'512MiB' -> 536870912, '4GiB', '1.5GB', '4096'. Raises ConfigError naming ``flag``."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(f"{flag}: cannot parse size {text!r}; use e.g. 512MiB, 4GiB, 10GB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.1f}{unit}" if unit != "B" else f"{int(num_bytes)}B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class HostTierConfig:
    capacity_bytes: int = 1 << 30
    shm_dir: Path = Path("/dev/shm")
    slab_bytes: int = 0  # 0: derived from capacity (capacity/16, clamped to [4 MiB, 64 MiB])
    hint_share: float = 0.5  # at most this share of the tier is protected/prefetched for hints
    hint_grace_s: float = 30.0  # a hint whose eta passed this long ago is dropped
    eviction: str = "slru"  # slru (one-shot pages go first) or lru
    demote_above: float = 0.95  # fuller than this, the demoter writes the coldest pages down ...
    demote_to: float = 0.90  # ... until it is down to this (1.0 and 1.0: only allocations evict)
    max_hints: int = 0  # announced uses (hinted keys) held at once, all callers; 0: one per KiB of capacity
    demote_sched: str = "idle"  # the demoter's background half: Linux's SCHED_IDLE class ("idle"), or "normal" at demote_nice
    demote_nice: int = 10  # OS niceness of its urgent half (of both, with "normal"): foreground RPCs come first on busy cores

    def __post_init__(self) -> None:
        if self.capacity_bytes < 4 << 20 and self.slab_bytes == 0:
            raise ConfigError("--host-capacity must be at least 4MiB")
        if not 0 <= self.hint_share <= 1:
            raise ConfigError("--hint-share must be in [0, 1]")
        if not 0 < self.demote_to <= self.demote_above <= 1:
            raise ConfigError("host demotion watermarks must satisfy 0 < --demote-to <= --demote-above <= 1")
        if not 0 <= self.demote_nice <= 19:
            raise ConfigError("--demote-nice must be in [0, 19]")
        if self.demote_sched not in DEMOTE_SCHEDS:
            raise ConfigError(f"--demote-sched must be one of {', '.join(DEMOTE_SCHEDS)}, got {self.demote_sched!r}")
        if self.max_hints < 0:
            raise ConfigError("--max-hints must be >= 0 (0: one per KiB of --host-capacity)")
        if self.max_hints == 0:
            object.__setattr__(self, "max_hints", max(1024, self.capacity_bytes // 1024))
        if self.eviction not in ("slru", "lru"):
            raise ConfigError(f"HostTierConfig.eviction must be slru or lru (no server flag sets it), got {self.eviction!r}")
        if self.slab_bytes == 0:
            derived = min(64 << 20, max(4 << 20, self.capacity_bytes // 16))
            object.__setattr__(self, "slab_bytes", derived - derived % 4096)
        if self.slab_bytes % 4096 or self.slab_bytes > self.capacity_bytes:
            raise ConfigError("host slab size must be a multiple of 4096 and at most --host-capacity")


@dataclass(frozen=True)
class HbmTierConfig:
    """The hbm tier: pools of page slots in GPU memory, one per tenant (one without tenant
    arenas), each of ``capacity_bytes`` (tiers/pools.py, tiers/hbm.py).

    ``device`` is a CUDA device ("cuda", "cuda:1"). "cpu" places the same pools in shared host
    memory to run the tier's logic without a GPU: a test-only emulation (``--hbm-device cpu``),
    never a deployment (nothing is faster than the host tier then)."""

    capacity_bytes: int = 4 << 30
    device: str = "cuda"
    slab_bytes: int = 0  # 0: derived from capacity (capacity/16, clamped to [4 MiB, 64 MiB])

    def __post_init__(self) -> None:
        if not re.fullmatch(r"cuda(:\d+)?|cpu", self.device):
            raise ConfigError(f"--hbm-device must be cuda, cuda:N or cpu (test-only emulation), got {self.device!r}")
        if self.capacity_bytes < 4 << 20 and self.slab_bytes == 0:
            raise ConfigError("--hbm-capacity must be at least 4MiB")
        if self.slab_bytes == 0:
            derived = min(64 << 20, max(4 << 20, self.capacity_bytes // 16))
            object.__setattr__(self, "slab_bytes", derived - derived % 4096)
        if self.slab_bytes % 4096 or self.slab_bytes > self.capacity_bytes:
            raise ConfigError("hbm slab size must be a multiple of 4096 and at most --hbm-capacity")


@dataclass(frozen=True)
class SsdTierConfig:
    directory: Path
    capacity_bytes: int = 16 << 30
    direct_io: bool = True  # O_DIRECT where the filesystem allows it
    dwpd: float = 1.0  # drive writes per day the endurance budget allows; 0: no budget
    burst_s: float = 60.0  # the budget's burst, in seconds of its long-run rate
    admission: str = "value"  # all | first-come | seen-twice | value
    sync: bool = True  # False only for trace replay: no fdatasync, no synced index
    slab_bytes: int = 0  # 0: derived from capacity
    index_map_bytes: int = MAP_BYTES  # LMDB map of the slot index; when full, writes to the tier are refused

    def __post_init__(self) -> None:
        if self.capacity_bytes < 16 << 20 and self.slab_bytes == 0:
            raise ConfigError("--ssd-capacity must be at least 16MiB")
        if self.index_map_bytes < MIN_MAP_BYTES:
            raise ConfigError("--lmdb-map-size must be at least 64KiB")
        if self.dwpd < 0:
            raise ConfigError("--ssd-dwpd must be >= 0 (0: no write budget)")
        if self.burst_s <= 0:
            raise ConfigError("--ssd-burst-s must be > 0")


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call the server and over what (kvstore/security/). No auth file and no TLS:
    every caller is the local tenant with every right, which only loopback allows unless
    ``insecure``."""

    auth_file: Path | None = None  # tokens -> tenant, rights, expiry (TOML or JSON); reloaded on SIGHUP
    tls_cert: Path | None = None  # the server's certificate chain (PEM) ...
    tls_key: Path | None = None  # ... and its private key
    tls_client_ca: Path | None = None  # mTLS: client certificates must be signed by this CA; they name the tenant
    insecure: bool = False  # serve off loopback without TLS or authentication, and /metrics off loopback
    share_arena: bool = False  # with tenants: one host arena for all of them, by path (they can read each other's pages)
    local_socket: Path | None = None  # a Unix socket for same-host clients: no TLS on it, tokens still checked

    @property
    def tenants(self) -> bool:
        """Whether callers are tenants (an auth file or client certificates name them)."""
        return self.auth_file is not None or self.tls_client_ca is not None

    @property
    def parts_per_owner(self) -> bool:
        """Whether each owner the placement core is given has an arena and an hbm pool of its own
        (tiers/arenas.py, tiers/pools.py): callers are tenants, and do not share (--share-arena)."""
        return self.tenants and not self.share_arena

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS with client certificates)")
        for flag, path in (("--auth-file", self.auth_file), ("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key),
                           ("--tls-client-ca", self.tls_client_ca)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag} {path}: no such file")


QUOTA_BYTES_FIELDS = ("host_bytes", "ssd_bytes", "token_log_bytes")


@dataclass(frozen=True)
class TenantQuota:
    """What one tenant may make the server hold (DESIGN §11); 0: no limit of its own (the
    server's capacity and limits still apply). Server-wide defaults come from the
    --tenant-* flags, a tenant's own from the auth file's ``quotas`` table. The local
    tenant of a server without --auth-file has none."""

    host_bytes: int = 0  # pages and allocated slots in this node's host tier; at the limit its own coldest go down
    ssd_bytes: int = 0  # pages in this node's ssd tier; at the limit its own coldest there make room
    ssd_write_percent: int = 0  # its share (percent of rate and burst) of the ssd write budget (--ssd-dwpd)
    leases: int = 16384  # leases held at once (Acquire, ReadPages streams)
    allocations: int = 4096  # allocations not yet committed or aborted
    hints: int = 262144  # announced uses (hinted keys) held at once
    token_log_bytes: int = 1 << 30  # token-log entries of its sessions (4 bytes a token)
    published_records: int = 262144  # other nodes' locations recorded by its Publish calls
    call_connections: int = 128  # connections to the same-host call socket at once (half its 256; each process also at most 32)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"--tenant-{name.replace('_', '-')} must be an integer >= 0 (0: no limit), got {value!r}")
        if self.ssd_write_percent > 100:
            raise ConfigError(f"--tenant-ssd-write-percent must be at most 100, got {self.ssd_write_percent}")


@dataclass(frozen=True)
class ClusterConfig:
    """Cluster mode (DESIGN §12; kvstore/server/cluster/). The node's name in locations is
    ``node_id``; peers reach it at ``advertise`` (gRPC) and ``advertise``'s host + the data
    port (UCX, TCP), or ``advertise_data_port`` where that differs (``data_address``)."""

    etcd: str  # etcd://host:port[,host:port...]
    node_id: str
    advertise: str  # HOST:PORT other nodes call this node's gRPC server at
    name: str = "default"  # the cluster's name: its keys live under /kvstore/<name>/ in etcd
    data_plane: str = "ucx"  # "ucx", "tcp" (plain sockets) or "grpc" (ReadPages streams)
    ucx_tls: str | None = None  # UCX_TLS (e.g. "tcp"); None: UCX chooses
    data_port: int = 0  # the UCX or TCP data listener's port (0: any free one; it is registered in etcd)
    advertise_data_port: int = 0  # the port peers reach that listener at (behind a NAT or a forward); 0: its own
    ttl_s: int = 10  # the membership lease
    join_timeout_s: float = 0.0  # a start that cannot join gives up after this (0: 3 TTLs, at least 10 s)
    replicas: int = 1  # directory owners of each page's record
    fetch_timeout_s: float = 5.0  # a remote fetch gives up after this (or the caller's deadline, if sooner)
    rpc_timeout_s: float = 2.0  # node-to-node directory calls (lookup, publish)
    token: str | None = None  # bearer token this node presents to the others

    def data_address(self, listening_port: int) -> str:
        """The data listener's address peers are told (etcd's member record): ``advertise``'s host
        and ``advertise_data_port``, or the port it listens on when that is 0."""
        return f"{self.advertise.rpartition(':')[0]}:{self.advertise_data_port or listening_port}"

    def __post_init__(self) -> None:
        if self.data_plane not in ("ucx", "tcp", "grpc"):
            raise ConfigError(f"--data-plane must be ucx, tcp or grpc, got {self.data_plane!r}")
        if ":" not in self.advertise or not self.advertise.rpartition(":")[2].isdigit() or self.advertise.endswith(":0"):
            raise ConfigError(f"--advertise must be HOST:PORT with a fixed port, got {self.advertise!r}")
        if not 0 <= self.advertise_data_port <= 65535:
            raise ConfigError(f"--advertise-data-port must be a port (0: the listener's own), got {self.advertise_data_port}")
        if not 2 <= self.ttl_s <= MAX_TTL_S:  # a fence wait well below the age etcd's incarnation is measured to (DESIGN §12.4)
            raise ConfigError(f"--cluster-ttl must be between 2 and {MAX_TTL_S} s, got {self.ttl_s}")
        if not 0 <= self.join_timeout_s < float("inf"):
            raise ConfigError(f"--cluster-join-timeout-s must be >= 0 (0: 3 TTLs, at least 10 s), got {self.join_timeout_s}")
        if self.replicas < 1:
            raise ConfigError("--cluster-replicas must be >= 1")
        if not (self.fetch_timeout_s > 0 and self.rpc_timeout_s > 0):
            raise ConfigError("--fetch-timeout-s and --cluster-rpc-timeout-s must be > 0")


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:7070"
    data_dir: Path = Path("./kvstore-data")
    tiers: tuple[str, ...] = ("host", "ssd")
    host: HostTierConfig = field(default_factory=HostTierConfig)
    ssd: SsdTierConfig | None = None
    hbm: HbmTierConfig = field(default_factory=HbmTierConfig)  # used when tiers names hbm
    metrics_listen: str | None = "127.0.0.1:9464"  # None: no /metrics endpoint
    node: str = "local"
    max_pages_per_request: int = 65536
    max_page_bytes: int = 64 << 20
    default_lease_ms: int = 30_000
    max_lease_ms: int = 600_000
    allocation_ttl_ms: int = 60_000
    workers: int = 16  # threads for unary calls; open streams hold max_streams threads of their own
    scrub_pages_per_s: float = 20.0  # background verification of SSD pages; 0: off
    max_streams: int = 32  # streaming RPCs open at once (each holds a thread); RESOURCE_EXHAUSTED beyond
    max_subscribers: int = 8  # Subscribe streams at once, within max_streams
    stream_idle_s: float = 30.0  # a stream that moves no message this long is cancelled
    keepalive_s: float = 30.0  # each connection is pinged this often ...
    keepalive_timeout_s: float = 10.0  # ... and closed, with its streams, when a ping goes unanswered this long
    max_hint_eta_s: float = 3600.0  # a hint further ahead is INVALID_ARGUMENT
    max_remote_records_per_node: int = 1 << 18  # locations Publish may record for one other node
    max_remote_records: int = 1 << 19  # ... and for all other nodes together (~0.8 KB of RSS each)
    directory_map_bytes: int = MAP_BYTES  # LMDB map of the directory's durable (remote) locations
    token_log_map_bytes: int = TOKEN_LOG_MAP_BYTES  # LMDB map of the token log
    session_idle_s: float = 86_400.0  # a session nothing was appended to this long is ended; 0: only by EndSession
    security: SecurityConfig = field(default_factory=SecurityConfig)
    cluster: ClusterConfig | None = None  # None: a single node, nothing of cluster mode is imported
    tenant_quota: TenantQuota = field(default_factory=TenantQuota)  # defaults; the auth file overrides per tenant

    def __post_init__(self) -> None:
        for tier in self.tiers:
            if tier not in LOCAL_TIER_NAMES:
                raise ConfigError(f"--tiers: unknown tier {tier!r}; known: {', '.join(LOCAL_TIER_NAMES)}")
        if "host" not in self.tiers:
            raise ConfigError("--tiers must include host: it is where pages land first")
        if "ssd" in self.tiers and self.ssd is None:
            raise ConfigError("--tiers includes ssd but no --ssd-dir was given")
        if ":" not in self.listen:
            raise ConfigError(f"--listen must be HOST:PORT, got {self.listen!r}")
        if self.workers <= 0:
            raise ConfigError("--workers must be > 0")
        if self.max_streams <= 0:
            raise ConfigError("--max-streams must be > 0")
        if not 0 < self.max_subscribers <= self.max_streams:
            raise ConfigError("--max-subscribers must be > 0 and at most --max-streams")
        for flag, value in (("--stream-idle-s", self.stream_idle_s), ("--keepalive-s", self.keepalive_s),
                            ("--keepalive-timeout-s", self.keepalive_timeout_s), ("--max-hint-eta-s", self.max_hint_eta_s)):
            if not value > 0:
                raise ConfigError(f"{flag} must be > 0")
        if self.max_remote_records_per_node <= 0 or self.max_remote_records <= 0:
            raise ConfigError("--max-remote-records-per-node and --max-remote-records must be > 0")
        if self.max_pages_per_request <= 0:
            raise ConfigError("max_pages_per_request must be > 0")
        if not (self.session_idle_s >= 0 and math.isfinite(self.session_idle_s)):
            raise ConfigError(f"--session-idle-s must be a number of seconds >= 0 (0: never), got {self.session_idle_s}")
        if min(self.directory_map_bytes, self.token_log_map_bytes) < MIN_MAP_BYTES:
            raise ConfigError("--lmdb-map-size must be at least 64KiB")
        check_exposure(self.listen, self.metrics_listen, self.security)
