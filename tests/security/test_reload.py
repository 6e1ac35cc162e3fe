"""kvstore-server re-reads --auth-file on SIGHUP: a revoked token stops working, a new one
starts, and a file that does not load keeps the previous one in force."""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.secure_server import ADMIN, ALICE, BOB, grants, secure_config, write_auth_file
from support.servers import ServerProcess

from kvstore._proto import directory_pb2, directory_pb2_grpc
from kvstore.security.channel import sync_channel

CAROL = "carol-token-0123456789abcdef"


class LoggedServer:
    """kvstore-server with --auth-file whose log lines (stderr) are read as they come."""

    def __init__(self, tmp: Path, auth_file: Path) -> None:
        self.process = ServerProcess(tmp, "--auth-file", str(auth_file), "--log-level", "info")
        self.process.start()
        assert self.process.proc is not None and self.process.proc.stderr is not None
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.process.proc.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.put(line)

    def hangup_and_wait_for(self, text: str) -> str:
        """Sends SIGHUP and returns the first log line after it that contains ``text``."""
        assert self.process.proc is not None
        self.process.proc.send_signal(signal.SIGHUP)
        while True:
            line = self.lines.get(timeout=20)
            if text in line:
                return line

    def status(self, token: str) -> grpc.StatusCode:
        with sync_channel(self.process.address, token=token) as channel:
            try:
                directory_pb2_grpc.DirectoryStub(channel).Stats(directory_pb2.StatsRequest(), timeout=10)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK


@pytest.fixture
def logged(tmp_path: Path) -> Iterator[LoggedServer]:
    server = LoggedServer(tmp_path, write_auth_file(tmp_path / "auth.json", grants()))
    yield server
    assert server.process.terminate() == 0


def test_a_token_removed_from_the_file_stops_working_after_sighup(logged, tmp_path) -> None:
    auth = tmp_path / "auth.json"
    assert (logged.status(ALICE), logged.status(BOB), logged.status(CAROL)) == (grpc.StatusCode.OK,) * 2 + (
        grpc.StatusCode.UNAUTHENTICATED,)
    kept = [g for g in grants() if g["token"] != ALICE]
    write_auth_file(auth, [*kept, {"tenant": "carol", "rights": ["read"], "token": CAROL}])
    logged.hangup_and_wait_for("reloaded")
    assert logged.status(ALICE) == grpc.StatusCode.UNAUTHENTICATED, "revoked"
    assert logged.status(BOB) == grpc.StatusCode.OK
    assert logged.status(CAROL) == grpc.StatusCode.OK, "added"


def test_a_file_that_does_not_load_on_reload_keeps_the_previous_one(logged, tmp_path) -> None:
    auth = tmp_path / "auth.json"
    for broken, why in (("{not json", "not valid JSON"), ('{"tokens": [{"tenant": "x", "rights": ["read"], "token": "short"}]}',
                                                          "16-4096 printable")):
        auth.write_text(broken)
        line = logged.hangup_and_wait_for("reload refused")
        assert why in line
        assert (logged.status(ALICE), logged.status(BOB)) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
    auth.unlink()
    assert "cannot read" in logged.hangup_and_wait_for("reload refused")
    assert logged.status(ALICE) == grpc.StatusCode.OK


async def test_revoking_a_token_ends_its_open_streams(server_factory, tmp_path, layout, ns) -> None:
    """A Subscribe stream opened with a token must not outlive the token's revocation: its
    next event is refused instead of delivered. (A subscriber sees only its own tenant's
    namespaces, so the next event is the operator invalidating alice's namespace.)"""
    from support.kv import random_kv

    from kvstore.client import KVStoreClient

    auth = write_auth_file(tmp_path / "auth.json", grants())
    server = server_factory(secure_config(tmp_path, auth_file=auth))
    with sync_channel(server.address, token=ALICE) as channel, sync_channel(server.address, token=ADMIN) as ops:
        events = directory_pb2_grpc.DirectoryStub(channel).Subscribe(directory_pb2.SubscribeRequest(from_seq=1), timeout=30)
        async with KVStoreClient(server.address, ns, use_shm=False, token=ALICE) as alice, \
                KVStoreClient(server.address, ns, use_shm=False, token=BOB) as bob:
            await alice.put(list(range(16)), random_kv(layout, 16))
            assert next(events).kind == directory_pb2.Event.STORED
            write_auth_file(auth, [g for g in grants() if g["token"] != ALICE])
            assert server.reload_security()
            directory_pb2_grpc.DirectoryStub(ops).Invalidate(
                directory_pb2.InvalidateRequest(namespace_id=alice.namespace.namespace_id), timeout=10)
            with pytest.raises(grpc.RpcError) as caught:
                next(events)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "stopped working while the stream was open" in caught.value.details()
            await bob.put(list(range(100, 116)), random_kv(layout, 16, seed=1))
            assert (await bob.lookup(list(range(100, 116)))).num_tokens == 16, "bob's token still works"
