"""Prometheus metrics of one server, on a registry of its own (several servers may share a
process in tests)."""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kvstore.memory import heap_bytes


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter("kvstore_hits", "Pages served, by the tier that held them", ["tier"], registry=r)
        self.misses = Counter("kvstore_misses", "Pages asked of a tier that did not hold them", ["tier"], registry=r)
        self.bytes_in = Counter("kvstore_bytes_in", "Page bytes written into a tier", ["tier"], registry=r)
        self.bytes_out = Counter("kvstore_bytes_out", "Page bytes read out of a tier", ["tier"], registry=r)
        self.pages = Gauge("kvstore_pages", "Pages stored, per tier", ["tier"], registry=r)
        self.used_bytes = Gauge("kvstore_used_bytes", "Bytes of slots in use, per tier", ["tier"], registry=r)
        self.capacity_bytes = Gauge("kvstore_capacity_bytes", "Tier capacity", ["tier"], registry=r)
        self.session_fences = Counter("kvstore_session_fences", "Live migrations: fences decided at this node (fence), "
                                      "aborts (abort), takeovers of a gone source (takeover)", ["kind"], registry=r)
        self.session_refusals = Counter("kvstore_session_fenced_refusals", "Session writes refused because the session "
                                        "is fenced or being fenced here (live migration)", ["call"], registry=r)
        self.sessions_expired = Counter("kvstore_sessions_expired", "Sessions of the token log ended because nothing was "
                                        "appended to them for --session-idle", registry=r)
        self.evictions = Counter("kvstore_evictions", "Pages evicted from a tier", ["tier"], registry=r)
        self.demotions = Counter("kvstore_demotions", "Pages moved down a tier under pressure", ["tier"], registry=r)
        self.promotions = Counter("kvstore_promotions", "Pages copied up into a faster tier on use", ["tier"], registry=r)
        self.quarantined = Counter("kvstore_quarantined", "Pages that failed a check and were quarantined", ["tier"], registry=r)
        self.admissions = Counter("kvstore_ssd_admissions", "SSD admission decisions", ["policy", "decision", "reason"], registry=r)
        self.ssd_refused_bytes = Counter("kvstore_ssd_refused_bytes", "Device bytes (header + padded page) not written to SSD (policy or budget)", registry=r)
        self.ssd_budget_fill = Gauge("kvstore_ssd_budget_fill", "Share of the SSD write burst available now", registry=r)
        self.ssd_write_rate = Gauge("kvstore_ssd_write_rate_bytes_per_second", "Average rate of bytes written to the SSD device (headers, padded pages, index)", registry=r)
        self.ssd_life_days = Gauge("kvstore_ssd_projected_life_days", "Drive life at the current write rate", registry=r)
        self.ssd_errors = Counter("kvstore_ssd_io_errors", "SSD writes that failed (disk full, I/O error)", registry=r)
        self.ssd_errors_recent = Gauge("kvstore_ssd_degraded", "1 while the last SSD write failed", registry=r)
        self.scrubbed = Counter("kvstore_scrubbed_pages", "SSD pages verified by the background scrub", registry=r)
        self.hints = Counter("kvstore_hints", "Pages hinted by the engine's queue", ["result"], registry=r)
        self.rpc_seconds = Histogram(
            "kvstore_rpc_seconds", "RPC latency", ["method"], registry=r,
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10),
        )
        # Per tenant (bounded: tenants are named in the auth file or by certificates the operator's CA signed).
        self.tenant_quota_refusals = Counter("kvstore_tenant_quota_refusals", "Calls refused (or pages kept off SSD) by a tenant's quota",
                                             ["tenant", "quota"], registry=r)
        self.tenant_ssd_written = Counter("kvstore_tenant_ssd_written_bytes", "SSD device bytes written for a tenant's pages",
                                          ["tenant"], registry=r)
        self.handoff_layer_bytes = Counter("kvstore_handoff_layer_bytes", "Layer-wise handoff pushes (DESIGN §12.7): bytes "
                                           "sent ahead of the pages' commit (prefill node) and landed (decode node)", ["side"], registry=r)
        self.handoff_layer_pages = Counter("kvstore_handoff_layer_pages", "Handed-off pages committed at the decode node from "
                                           "the layers that came ahead (not fetched whole)", registry=r)
        self.rpc_errors = Counter("kvstore_rpc_errors", "RPCs answered with an error status", ["method", "code"], registry=r)
        # The C heap at scrape time (glibc; absent elsewhere): a leak of C allocations grows in_use; free is
        # malloc's free space, resident or not (kvstore/memory.py heap_bytes).
        if heap_bytes() is not None:
            heap = Gauge("kvstore_heap_bytes", "C heap of the server process (glibc mallinfo2)", ["state"], registry=r)
            heap.labels("in_use").set_function(lambda: heap_bytes()["in_use"])  # type: ignore[index]
            heap.labels("free").set_function(lambda: heap_bytes()["free"])  # type: ignore[index]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged (as prometheus_client's own handler)."""


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """``registry`` at /metrics over HTTP, served on a daemon thread: prometheus_client's
    start_http_server, except that its loop looks for a shutdown every 50 ms; the library's
    0.5 s made every stop of a server wait up to that long in ``shutdown()``."""
    family, *_, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})  # IPv4 or IPv6, as host is
    httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), server_class, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), name="metrics-http", daemon=True).start()
    return httpd
