"""Both listeners of the server's host (the call socket, the arena socket) out of file
descriptors: kvstore/accept_pause.py, the one pause both use, tested through each."""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.secure_server import ALICE, grants, write_auth_file
from test_arena_socket import Arenas

from kvstore._proto import data_pb2
from kvstore.accept_pause import RETRY_S, AcceptPause
from kvstore.callsocket.client_sync import CallChannel
from kvstore.security.arena_socket import ArenaSocket, receive_arena
from kvstore.security.authenticator import Authenticator
from kvstore.security.salts import TenantSalts


@dataclass
class Listener:
    path: Path
    pause: AcceptPause
    logger: str
    serves: Callable[[], None]  # raises unless a new connection is served


@pytest.fixture(params=["call socket", "arena socket"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    if request.param == "call socket":
        server = request.getfixturevalue("server")
        calls = server.call_socket

        def call_serves() -> None:
            channel = CallChannel.open(str(calls.path), None, calls.call_token, 5.0)
            assert channel is not None, "the call socket serves no HELLO"
            channel.call("Data.WhoAmI", data_pb2.WhoAmIRequest(), data_pb2.WhoAmIResponse)
            channel.close()

        yield Listener(calls.path, calls.accept_pause, "kvstore.callsocket.socket_server", call_serves)
        return
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    arenas = Arenas()
    door = ArenaSocket(data / "arena.sock", Authenticator(write_auth_file(tmp_path / "auth.json", grants()),
                                                          TenantSalts(data)), arenas, timeout_s=2.0)
    door.start()

    def arena_serves() -> None:
        fd, _, tenant = receive_arena(door.path, ALICE)
        os.close(fd)
        assert tenant == "alice"

    yield Listener(door.path, door.accept_pause, "kvstore.security.arena_socket", arena_serves)
    door.stop()
    arenas.close()


CALLERS = 16  # connections waiting in the backlog while the descriptors are gone (the arena socket serves 32 a process)


def _hog(socks: list[socket.socket]) -> None:
    """Takes every descriptor free under the limit."""
    try:
        while True:
            socks.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    except OSError:
        pass


def test_accept_out_of_descriptors_pauses_instead_of_spinning(listener: Listener, caplog: pytest.LogCaptureFixture) -> None:
    """Out of file descriptors (EMFILE: the process limit, reachable by callers that hold
    connections) accept fails while the connection stays in the backlog. The call socket's
    loop retried at once with a traceback a try, the arena socket's selector woke at once
    with a warning a turn: thousands a second at full CPU. Each pauses RETRY_S between tries,
    logs at most once per interval, and serves again once descriptors are free."""
    caplog.set_level(logging.WARNING, logger=listener.logger)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # More callers than descriptors the server's threads free meanwhile: each one freed (a
    # transient file, a closed connection) lets an accept through. With as many callers as
    # hogged descriptors, a server closing a few let all of them in and accept never failed.
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(CALLERS)]
    callers = list(socks)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
    try:
        _hog(socks)  # this process's last descriptors: the server's accept finds none
        for sock in callers:
            sock.setblocking(False)  # a full backlog answers EAGAIN instead of blocking
        waiting = [sock.connect_ex(str(listener.path)) for sock in callers]
        assert waiting.count(0) > 0, f"no caller got into the backlog: {[errno.errorcode.get(e, e) for e in waiting]}"
        deadline = time.monotonic() + 10
        while not listener.pause.num_failed and time.monotonic() < deadline:  # the loop met EMFILE (bounded)
            _hog(socks)  # a descriptor freed meanwhile (the server's other threads' too) is taken before an accept takes it
            time.sleep(0.01)
        first = listener.pause.num_failed
        time.sleep(0.5)  # what the loop does meanwhile is the point
        tries = listener.pause.num_failed - first
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for sock in socks:
            sock.close()
    assert first > 0, "accept never failed: the test did not exhaust the descriptors"
    assert tries <= 0.5 / RETRY_S + 5, f"{tries} failed accepts in 0.5 s: a spin, not a pause"
    failures = [r for r in caplog.records if "accept failed" in r.getMessage()]
    assert 0 < len(failures) <= 2, f"{len(failures)} accept failures logged in 0.5 s"
    listener.serves()
