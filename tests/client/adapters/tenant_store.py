"""A kvstore-server process with --auth-file and two tenants, for the engine adapters' tests:
the tokens, and what the server holds (leases) as the operator's admin token sees it."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from support.servers import ServerProcess

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.bench.common.harness import KILL_WAIT_S

TOKEN_A = "tenant-a-token-0123456789abcdef"  # tenant a: read, write
TOKEN_A2 = "tenant-a-other-0123456789abcde"  # tenant a too, another token
TOKEN_B = "tenant-b-token-0123456789abcdef"  # tenant b: read, write
TOKEN_OPS = "tenant-ops-token-0123456789abcd"  # the operator: admin
TOKEN_UNKNOWN = "nobodys-token-0123456789abcdef"


def tenant_server(tmp: Path, *args: str) -> ServerProcess:
    """A started kvstore-server whose auth file has tenants a and b (and an admin); ``args``: more flags."""
    auth = tmp / "auth.json"
    auth.write_text(json.dumps({"tokens": [
        {"tenant": "a", "rights": ["read", "write"], "token": TOKEN_A},
        {"tenant": "a", "rights": ["read", "write"], "token": TOKEN_A2},
        {"tenant": "b", "rights": ["read", "write"], "token": TOKEN_B},
        {"tenant": "ops", "rights": ["read", "write", "admin"], "token": TOKEN_OPS},
    ]}))
    auth.chmod(0o600)
    server = ServerProcess(tmp, "--auth-file", str(auth), *args)
    server.start()
    return server


def stop(server: ServerProcess) -> None:
    if server.proc is not None and server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(KILL_WAIT_S)
    server.close_pipes()


def num_leases(address: str) -> int:
    """Leases the server holds, for every tenant (the admin's Stats)."""
    with grpc.insecure_channel(address) as channel:
        stats = directory_pb2_grpc.DirectoryStub(channel).Stats(
            directory_pb2.StatsRequest(), timeout=10, metadata=[("authorization", f"Bearer {TOKEN_OPS}")])
        return int(stats.num_leases)
