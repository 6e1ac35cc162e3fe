"""The server: placement core, leases, admission, eviction, recovery, token log, services
(thin gRPC servicers), metrics and the process that runs them. Imports the leaves, the
directory and the tiers; nothing imports it but the CLI, benchmarks and tests."""

from kvstore.server.process import Server

__all__ = ["Server"]
