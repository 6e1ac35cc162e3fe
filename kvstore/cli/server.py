"""kvstore-server: parses flags into a ServerConfig and runs until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import gc
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from kvstore import logs
from kvstore.config import (
    DEMOTE_SCHEDS,
    MAP_BYTES,
    QUOTA_BYTES_FIELDS,
    TOKEN_LOG_MAP_BYTES,
    ClusterConfig,
    HbmTierConfig,
    HostTierConfig,
    SecurityConfig,
    ServerConfig,
    SsdTierConfig,
    TenantQuota,
    format_size,
    parse_size,
)
from kvstore.errors import ConfigError, KVStoreError
from kvstore.memory import HEAP_TRIM_S, HeapTrimmer, tune_malloc, without_tcache
from kvstore.security.undumpable import forbid_inspection

logger = logging.getLogger("kvstore.server")


DEFAULT_SWITCH_INTERVAL_MS = 0.5  # why 0.5: set_switch_interval
STOP_TIMEOUT_S = 15.0  # past gRPC's 5 s grace for calls in flight and the threads' 5 s joins
MIN_SWITCH_INTERVAL_MS = 0.001  # CPython's resolution (1 us)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
_LIMIT_FLAGS: list[tuple[str, type, str]] = [
    ("--workers", int, "threads for unary calls (Lookup, Stats, Allocate...); streams get --max-streams more"),
    ("--max-streams", int, "streaming RPCs open at once (WritePages, ReadPages, Subscribe); RESOURCE_EXHAUSTED beyond"),
    ("--max-subscribers", int, "Subscribe streams at once, within --max-streams"),
    ("--stream-idle-s", float, "a stream that moves no message this long is cancelled"),
    ("--keepalive-s", float, "each connection is pinged this often"),
    ("--keepalive-timeout-s", float, "a connection whose ping is unanswered this long is closed, with its streams"),
    ("--max-hint-eta-s", float, "a hint further ahead is refused (INVALID_ARGUMENT)"),
    ("--max-remote-records-per-node", int, "locations Publish may record for one other node; RESOURCE_EXHAUSTED beyond"),
    ("--max-remote-records", int, "locations Publish may record for all other nodes together"),
    ("--session-idle-s", float, "a session of the token log nothing was appended to this long is ended (0: only by EndSession)"),
]


_QUOTA_DEFAULTS = TenantQuota()
_QUOTA_HELP = {
    "host_bytes": "pages and allocated slots in the host tier", "ssd_bytes": "pages in the ssd tier",
    "ssd_write_percent": "share of the ssd write budget (--ssd-dwpd), in percent of its rate and burst",
    "leases": "leases held at once", "allocations": "allocations not yet committed or aborted",
    "hints": "hinted keys held at once", "token_log_bytes": "token-log bytes of its sessions",
    "published_records": "other nodes' locations its Publish calls record",
    "call_connections": "connections to the same-host call socket at once (the socket serves 256 in all)",
}


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-server", description="Tiered KV-cache store for LLM inference.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tiers", default="host,ssd", help="comma-separated tiers: hbm,host,ssd")
    p.add_argument("--listen", default="127.0.0.1:7070", help="gRPC address HOST:PORT (port 0: any free port)")
    p.add_argument("--data-dir", default="./kvstore-data", help="server state: the directory and token log (LMDB), tenant salts, ssd pages unless --ssd-dir")
    p.add_argument("--host-capacity", default="1GiB", help="shared-memory arena size, e.g. 512MiB, 4GiB")
    p.add_argument("--hbm-capacity", default="4GiB", help="GPU memory pool of the hbm tier, per tenant (with --tiers hbm,...)")
    p.add_argument("--hbm-device", default="cuda",
                   help="device of the hbm pool: cuda or cuda:N; 'cpu' emulates it in host memory, for tests only")
    p.add_argument("--ssd-dir", default=None, help="where ssd pages live (None: DATA_DIR/ssd)")
    p.add_argument("--ssd-capacity", default="8GiB", help="ssd tier capacity")
    p.add_argument("--no-direct-io", action="store_true", help="use buffered I/O on the ssd tier even where O_DIRECT works")
    p.add_argument("--ssd-dwpd", type=float, default=1.0, help="drive writes per day the SSD endurance budget allows (0: no budget)")
    p.add_argument("--ssd-burst-s", type=float, default=60.0, help="write budget burst, in seconds of its long-run rate")
    p.add_argument("--ssd-admission", default="value", help="SSD admission policy: value, seen-twice, first-come, all")
    p.add_argument("--scrub-rate", type=float, default=20.0, help="SSD pages verified per second in the background (0: off)")
    p.add_argument("--demote-sched", default="idle", choices=DEMOTE_SCHEDS,
                   help="the background demoter: idle (Linux's SCHED_IDLE: it drains on CPU the foreground leaves; "
                        "when an allocation finds no room, an urgent demoter at --demote-nice drains with it) or "
                        "normal (one demoter, at --demote-nice)")
    p.add_argument("--demote-nice", type=int, default=10,
                   help="OS niceness (0-19) of the urgent demoter (of the only one, with --demote-sched normal): on "
                        "busy cores lookups and other foreground RPCs get the CPU first")
    p.add_argument("--switch-interval-ms", type=float, default=DEFAULT_SWITCH_INTERVAL_MS,
                   help="how long a Python thread may hold the GIL while another waits for it (CPython's "
                        "default: 5 ms); short, a lookup waits less behind a demoting or writing thread (0.1: "
                        "kvstore-bench lookup's draining p99 18-38%% lower than at 0.5; the test suite took 16-25%% more CPU)")
    p.add_argument("--heap-trim-s", type=float, default=HEAP_TRIM_S,
                   help="give the C heap's free pages back to the kernel this often (0: never; a long-running server "
                        "otherwise grows under churn)")
    p.add_argument("--stop-timeout-s", type=float, default=STOP_TIMEOUT_S,
                   help="a stop (SIGTERM, SIGINT) still running after this long writes every thread's stack to stderr "
                        "and exits 1, as a crash would (what was acknowledged is on disk already); 0: wait for ever")
    p.add_argument("--malloc-tcache", choices=("off", "on"), default="off",
                   help="glibc's per-thread cache of freed chunks; off (the server restarts itself once at start with "
                        "GLIBC_TUNABLES set, unless that names a tcache count already): its memory stays bounded")
    p.add_argument("--demote-above", type=float, default=0.95,
                   help="host tier fill (0-1) past which the background demoter starts writing the coldest pages down")
    p.add_argument("--demote-to", type=float, default=0.90,
                   help="host tier fill (0-1) the demoter writes pages down to once started (a low value keeps RAM "
                        "free for bursts at the cost of more SSD writes)")
    p.add_argument("--hint-share", type=float, default=0.5, help="share of the host tier that queue hints may protect")
    p.add_argument("--metrics-listen", default="127.0.0.1:9464", help="Prometheus /metrics address; 'off' to disable")
    p.add_argument("--node", default="local", help="this node's name in locations")
    p.add_argument("--lmdb-map-size", default=None,
                   help="size of each LMDB map (directory, token log, ssd index); a full one refuses writes "
                        "(None: 8GiB, 4GiB for the token log)")
    limits = p.add_argument_group("limits", "what callers can make the server hold")
    for flag, kind, text in _LIMIT_FLAGS:
        limits.add_argument(flag, type=kind, default=_DEFAULTS[_field(flag)], help=text)
    limits.add_argument("--max-hints", type=int, default=0,
                        help="hinted keys held at once, all callers together; RESOURCE_EXHAUSTED beyond "
                             "(0: one per KiB of --host-capacity)")
    quotas = p.add_argument_group("tenant quotas", "per tenant; one exceeded is RESOURCE_EXHAUSTED for that tenant only. The auth "
                                  "file's [quotas.TENANT] tables override them; 0: no limit; none without --auth-file or mTLS")
    for name, text in _QUOTA_HELP.items():
        default = getattr(_QUOTA_DEFAULTS, name)
        shown = (format_size(default) if default else "0") if name in QUOTA_BYTES_FIELDS else str(default)
        quotas.add_argument(f"--tenant-{name.replace('_', '-')}", default=shown, help=text)
    security = p.add_argument_group("security", "who may call, and over what (see README: Security)")
    security.add_argument("--auth-file", help="TOML or JSON file of tokens -> tenant, rights, expiry; re-read on SIGHUP")
    security.add_argument("--tls-cert", help="serve TLS with this certificate chain (PEM)")
    security.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
    security.add_argument("--tls-client-ca", help="mTLS: require client certificates signed by this CA; they name the tenant")
    security.add_argument("--insecure", action="store_true",
                          help="allow a non-loopback --listen without TLS or authentication, and a non-loopback --metrics-listen")
    security.add_argument("--local-socket", metavar="PATH",
                          help="also listen on this Unix socket (mode 0600), for clients on this host (address unix:PATH): "
                               "without TLS on it, since nothing on it crosses a network, but with the same tokens and "
                               "tenants as --listen")
    security.add_argument("--share-arena", action="store_true",
                          help="with --auth-file or mTLS: one shared-memory arena for all tenants, announced by path "
                               "(whoever maps it reads and writes every tenant's pages: only for tenants that trust each "
                               "other); by default each tenant has its own arena, handed to its tokens over a Unix socket")
    cluster = p.add_argument_group("cluster", "join a cluster of nodes on etcd (DESIGN §12); without --cluster: one node")
    cluster.add_argument("--cluster", metavar="etcd://HOST:PORT[,HOST:PORT]", help="etcd endpoints of the cluster")
    cluster.add_argument("--node-id", help="this node's unique name in the cluster (replaces --node)")
    cluster.add_argument("--advertise", help="HOST:PORT other nodes reach this node's gRPC server at (None: --listen)")
    cluster.add_argument("--data-plane", default="ucx", choices=["ucx", "tcp", "grpc"],
                         help="how page bytes move node to node: UCX (ucxx), plain TCP sockets (each asks for cubic "
                              "congestion control: root, or cubic in net.ipv4.tcp_allowed_congestion_control; else the "
                              "default is kept and logged), or gRPC ReadPages streams (the only one with TLS). "
                              "ucx and tcp send page bytes unencrypted, each connection admitted by a one-time grant "
                              "asked over authenticated gRPC")
    cluster.add_argument("--ucx-tls", default=None, help="UCX_TLS for the data plane, e.g. tcp or sm,self,tcp (None: UCX chooses)")
    cluster.add_argument("--data-port", type=int, default=0, help="the UCX or TCP data listener's port (0: any free one)")
    cluster.add_argument("--advertise-data-port", type=int, default=0,
                         help="the port other nodes reach the data listener at, on --advertise's host (behind a NAT or a port "
                              "forward; UCX sets up connections there but its transport may use addresses of its own; 0: the "
                              "listener's own)")
    cluster.add_argument("--cluster-name", default="default", help="keys live under /kvstore/NAME/ in etcd")
    cluster.add_argument("--cluster-ttl", type=int, default=10, help="membership lease TTL in seconds")
    cluster.add_argument("--cluster-join-timeout-s", type=float, default=0.0,
                         help="a start that cannot join the cluster gives up after this (0: 3 TTLs, at least 10 s: a "
                              "restarted node waits for its previous lease to expire)")
    cluster.add_argument("--cluster-replicas", type=int, default=1, help="directory owners per page record")
    cluster.add_argument("--fetch-timeout-s", type=float, default=5.0,
                         help="a remote page fetch gives up after this, or the caller's deadline if sooner")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="least severity logged (stderr)")
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one object a line, for log shippers")
    return p


def set_switch_interval(ms: float) -> None:
    """Sets the process's GIL switch interval. With CPython's 5 ms a lookup that arrives
    while the demoter or a put holds the GIL waits up to that long for it: the lookup p99
    under demotion sat at ~5 ms against ~0.6 ms idle (kvstore-bench lookup, 2 cores). At
    0.5 ms the slowest 1% of draining lookups still waited ~0.4 ms for the demoter's Python
    between its writes; 0.1 ms took the draining p99 of client.lookup_keys from 0.86-1.14 to
    0.60-0.91 ms, and kvstore-bench throughput moved within its spread, but a fresh-clone make
    test took 16-25% more user CPU on the two trees with it than on the one before (not an A/B
    of the interval alone), so 0.5 stays the default."""
    if not MIN_SWITCH_INTERVAL_MS <= ms < math.inf:  # CPython keeps microseconds: less, or inf, is 0
        raise ConfigError(f"--switch-interval-ms must be > 0 (at least {MIN_SWITCH_INTERVAL_MS}) and finite, got {ms}")
    sys.setswitchinterval(ms / 1e3)


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


def cluster_from_args(args: argparse.Namespace) -> ClusterConfig | None:
    if not args.cluster:
        if args.node_id or args.advertise:
            raise ConfigError("--node-id and --advertise need --cluster")
        return None
    if not args.node_id:
        raise ConfigError("--cluster needs --node-id")
    return ClusterConfig(
        etcd=args.cluster, node_id=args.node_id, advertise=args.advertise or args.listen, name=args.cluster_name,
        data_plane=args.data_plane, ucx_tls=args.ucx_tls, data_port=args.data_port, advertise_data_port=args.advertise_data_port,
        ttl_s=args.cluster_ttl, join_timeout_s=args.cluster_join_timeout_s, replicas=args.cluster_replicas,
        fetch_timeout_s=args.fetch_timeout_s,
        token=os.environ.get("KVSTORE_CLUSTER_TOKEN") or None,  # a secret: not on the command line
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    cluster = cluster_from_args(args)
    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    map_bytes = parse_size(args.lmdb_map_size, "--lmdb-map-size") if args.lmdb_map_size else None
    data_dir = Path(args.data_dir)
    ssd = None
    if "ssd" in tiers:
        ssd = SsdTierConfig(
            directory=Path(args.ssd_dir) if args.ssd_dir else data_dir / "ssd",
            capacity_bytes=parse_size(args.ssd_capacity, "--ssd-capacity"),
            direct_io=not args.no_direct_io,
            dwpd=args.ssd_dwpd,
            burst_s=args.ssd_burst_s,
            admission=args.ssd_admission,
            index_map_bytes=map_bytes or MAP_BYTES,
        )
    return ServerConfig(
        listen=args.listen,
        data_dir=data_dir,
        tiers=tiers,
        host=HostTierConfig(capacity_bytes=parse_size(args.host_capacity, "--host-capacity"), hint_share=args.hint_share,
                            max_hints=args.max_hints, demote_nice=args.demote_nice, demote_sched=args.demote_sched,
                            demote_above=args.demote_above, demote_to=args.demote_to),
        ssd=ssd,
        hbm=HbmTierConfig(capacity_bytes=parse_size(args.hbm_capacity, "--hbm-capacity"), device=args.hbm_device),
        metrics_listen=None if args.metrics_listen == "off" else args.metrics_listen,
        node=cluster.node_id if cluster else args.node,
        cluster=cluster,
        scrub_pages_per_s=args.scrub_rate,
        directory_map_bytes=map_bytes or MAP_BYTES,
        token_log_map_bytes=map_bytes or TOKEN_LOG_MAP_BYTES,
        security=SecurityConfig(
            auth_file=_path(args.auth_file), tls_cert=_path(args.tls_cert), tls_key=_path(args.tls_key),
            tls_client_ca=_path(args.tls_client_ca), insecure=args.insecure, share_arena=args.share_arena,
            local_socket=_path(args.local_socket),
        ),
        tenant_quota=_tenant_quota(args),
        **{_field(flag): getattr(args, _field(flag)) for flag, _, _ in _LIMIT_FLAGS},
    )


def _tenant_quota(args: argparse.Namespace) -> TenantQuota:
    values = {}
    for name in _QUOTA_HELP:
        flag, text = f"--tenant-{name.replace('_', '-')}", getattr(args, f"tenant_{name}")
        if name in QUOTA_BYTES_FIELDS:
            values[name] = parse_size(text, flag)
        elif text.isdigit():
            values[name] = int(text)
        else:
            raise ConfigError(f"{flag} must be an integer >= 0, got {text!r}")
    return TenantQuota(**values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.malloc_tcache == "off":
        without_tcache()  # returns once it is off (this process started again) or cannot be
    logs.setup(args.log_level, args.log_format)
    tune_malloc()
    if not (args.heap_trim_s >= 0 and math.isfinite(args.heap_trim_s)):
        print(f"kvstore-server: --heap-trim-s must be a number of seconds >= 0, got {args.heap_trim_s}", file=sys.stderr)
        return 2
    if not (args.stop_timeout_s >= 0 and math.isfinite(args.stop_timeout_s)):
        print(f"kvstore-server: --stop-timeout-s must be a number of seconds >= 0, got {args.stop_timeout_s}", file=sys.stderr)
        return 2
    trimmer = HeapTrimmer(args.heap_trim_s)
    from kvstore.server import Server

    try:
        config = config_from_args(args)
        set_switch_interval(args.switch_interval_ms)
        if config.security.tenants and not config.security.share_arena:
            forbid_inspection()  # tenants' arenas are descriptors here: keep same-uid processes out of /proc/<pid>/fd
        server = Server(config)
        server.start()  # a start that fails stops what was built or started (the arena in /dev/shm, call.sock, the dir lock)
        # What start-up made (modules, the recovered directory and ssd index) lives as long as
        # the process: out of the cyclic GC's reach, a full collection walks only what came
        # since. Walking all of it stalled every thread, a lookup's too, 30-50 ms at a time
        # while pages were written and demoted (kvstore-bench lookup, 2 cores).
        gc.freeze()
        trimmer.start()
    except (KVStoreError, OSError, RuntimeError) as exc:
        message = str(exc) if isinstance(exc, KVStoreError) else f"cannot start: {exc}"
        logger.error("%s", message)
        print(f"kvstore-server: {message}", file=sys.stderr)
        return 2
    signals = _signal_pipe()
    print(f"kvstore-server ready on {server.address}", flush=True)

    def on_hangup() -> None:  # re-read --auth-file (revoked tokens stop working), on a thread: a slow read delays no stop
        threading.Thread(target=server.reload_security, name="reload", daemon=True).start()

    signum = _wait_for_stop(signals, on_hangup)
    logger.info("received %s, shutting down", signal.Signals(signum).name)
    stopped = threading.Event()
    if args.stop_timeout_s > 0:  # a stop that hangs says where, and ends
        threading.Thread(target=_stop_watchdog, args=(args.stop_timeout_s, stopped), name="stop-watchdog", daemon=True).start()
        # the backstop, should the stop hold the GIL: faulthandler's own thread reads the others' frames without
        # it, and crashed the process (SIGSEGV) once in CI doing so while they ran
        faulthandler.dump_traceback_later(args.stop_timeout_s + STOP_BACKSTOP_S, exit=True)
    trimmer.stop()
    server.stop()
    stopped.set()
    faulthandler.cancel_dump_traceback_later()
    return 0


STOP_BACKSTOP_S = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _signal_pipe() -> int:
    """SIGTERM, SIGINT and SIGHUP as their numbers on a pipe, whose read end is returned for
    ``_wait_for_stop``. The handlers do nothing (DESIGN §12.9 "Stopping"): Python runs one on the
    main thread between two of its bytecodes, and one that took a lock (Event.set) hung the
    process for good whenever the main thread held that lock."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)  # written by whichever thread takes the signal
    for signum in (*STOP_SIGNALS, signal.SIGHUP):
        signal.signal(signum, _noted)
    return read_fd


def _noted(_signum: int, _frame: object) -> None:
    """Nothing: the signal's number is on the wakeup pipe already."""


def _wait_for_stop(read_fd: int, on_hangup: Callable[[], object]) -> int:
    """Reads signal numbers off ``read_fd`` until SIGTERM or SIGINT, which it returns; calls
    ``on_hangup`` for each SIGHUP."""
    while True:
        for signum in os.read(read_fd, 64):  # blocking; a read interrupted by a signal goes on (PEP 475)
            if signum in STOP_SIGNALS:
                return signum
            if signum == signal.SIGHUP:
                on_hangup()


def _stop_watchdog(timeout_s: float, stopped: threading.Event) -> None:
    """Past ``timeout_s`` of the stop: every thread's stack to stderr, then exit 1. The dump runs on
    this thread holding the GIL, so no other thread's Python frames change under it."""
    if stopped.wait(timeout_s):
        return
    print(f"Timeout ({datetime.timedelta(seconds=timeout_s)})!", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
