"""The kvstore server: tier manager + Directory and Data services + /metrics."""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import start_http_server

from kvstore import pagecopy
from kvstore._proto import directory_pb2_grpc
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError
from kvstore.metrics import Metrics
from kvstore.service import DirectoryService
from kvstore.service_data import DataService
from kvstore.tier_manager import TierManager
from kvstore.wal import TokenLog
from kvstore.wire import add_data_service

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def split_host_port(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{flag} must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


class Server:
    """Owns the gRPC server, the tier manager and the metrics endpoint.

    ``start()`` binds (port 0 picks a free one; see ``port``); ``stop()`` stops taking RPCs,
    lets running ones finish within ``grace_s``, then closes the tiers (the arena file is
    unlinked; ssd pages and the directory stay on disk).
    """

    def __init__(self, config: ServerConfig) -> None:
        if "hbm" in config.tiers:
            from kvstore.tiers.hbm import require_cuda

            require_cuda()
        self.config = config
        self.metrics = Metrics()
        self.manager = TierManager(config, self.metrics)
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="rpc"), options=GRPC_OPTIONS)
        directory_pb2_grpc.add_DirectoryServicer_to_server(DirectoryService(self.manager, config), self._grpc)
        self.wal = TokenLog(config.data_dir, config.token_log_map_bytes)
        add_data_service(DataService(self.manager, config, self.wal), self._grpc)
        self.port = 0
        self.metrics_port = 0
        self._metrics_http: WSGIServer | None = None
        self._stopped = threading.Event()
        self._scrubber: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, _ = split_host_port(self.config.listen, "--listen")
        return f"{host}:{self.port}"

    def start(self) -> None:
        self.port = self._grpc.add_insecure_port(self.config.listen)
        if self.port == 0:
            raise ConfigError(f"--listen {self.config.listen}: cannot bind (address in use?)")
        self._grpc.start()
        if self.config.scrub_pages_per_s > 0 and self.manager.ssd is not None:
            self._scrubber = threading.Thread(target=self._scrub, name="scrub", daemon=True)
            self._scrubber.start()
        if self.config.metrics_listen:
            host, port = split_host_port(self.config.metrics_listen, "--metrics-listen")
            self._metrics_http, _ = start_http_server(port, addr=host, registry=self.metrics.registry)
            self.metrics_port = self._metrics_http.server_port
        logger.info(
            "kvstore-server listening on %s (tiers %s, %s, page copies %s)",
            self.address, ",".join(self.config.tiers),
            f"metrics on {self.config.metrics_listen.rsplit(':', 1)[0]}:{self.metrics_port}"
            if self._metrics_http else "metrics off",
            "native" if pagecopy.NATIVE else f"in numpy, ~1.4x slower: {pagecopy.NATIVE_MISSING}",
        )

    def _scrub(self) -> None:
        """Verifies SSD pages at a bounded rate so that damage is found before a reader
        needs the page."""
        interval = 1.0 / self.config.scrub_pages_per_s
        while not self._stopped.wait(interval):
            try:
                if self.manager.scrub_one() is None:
                    self._stopped.wait(1.0)
            except Exception:  # the scrub must outlive one bad round
                logger.exception("scrub round failed")

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._scrubber is not None:
            self._scrubber.join(5)
        self.manager.directory.events.close()
        self._grpc.stop(grace_s).wait()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self.manager.close()
        self.wal.close()
        logger.info("kvstore-server stopped")

    def wait(self) -> None:
        self._grpc.wait_for_termination()
