"""A client sends its bearer token in clear text to a loopback TCP port only when every socket
bound to that port belongs to its own uid or root (DESIGN §12.4): while the server
restarts, a process of another uid can bind the port and collect the tokens of the clients
that reconnect. The same rule the call and arena sockets keep with SO_PEERCRED
(test_socket_squatter.py).

The squatter runs as uid 65534 (nobody) from the system Python (stdlib only): the suite runs
as root, as CI does."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from support.kv import random_kv
from support.secure_server import ADMIN, ALICE, grants, secure_config, write_auth_file

from kvstore.cli import ctl
from kvstore.client import KVStoreClient
from kvstore.errors import Unauthenticated
from kvstore.security import loopback_owner
from kvstore.security.channel import aio_channel, call_metadata
from kvstore.types import Namespace

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # nobody may run it (the venv's may be under /root)

# Binds 127.0.0.1 (port 0 unless given), answers as an HTTP/2 server would (its SETTINGS and an
# ack of the client's, after which a gRPC client sends its calls' HEADERS) and keeps every byte
# it hears; prints them when its stdin closes. "linger": after its first accept it closes the
# listener and keeps that connection (an accepted socket of its uid stays on the port).
SQUATTER = """
import selectors, socket, sys
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(8)
print(listener.getsockname()[1], flush=True)
linger = sys.argv[2] == "linger"
sel = selectors.DefaultSelector()
sel.register(listener, selectors.EVENT_READ)
sel.register(sys.stdin, selectors.EVENT_READ)
heard = b""
while True:
    for key, _ in sel.select():
        if key.fileobj is sys.stdin:
            print(repr(heard), flush=True)
            sys.exit(0)
        if key.fileobj is listener:
            conn, _ = listener.accept()
            conn.sendall(b"\\0\\0\\0\\x04\\0\\0\\0\\0\\0" + b"\\0\\0\\0\\x04\\x01\\0\\0\\0\\0")
            sel.register(conn, selectors.EVENT_READ)
            if linger:
                sel.unregister(listener)
                listener.close()
                print("closed", flush=True)
        else:
            chunk = key.fileobj.recv(65536)
            heard += chunk
            if not chunk:
                sel.unregister(key.fileobj)
"""


class Squatter:
    """A listener of uid nobody on a loopback port; ``heard()`` ends it and returns its bytes."""

    def __init__(self, port: int = 0, mode: str = "listen") -> None:
        self._proc = subprocess.Popen([SYSTEM_PYTHON, "-c", SQUATTER, str(port), mode], user=NOBODY, group=NOBODY,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())
        self.address = f"127.0.0.1:{self.port}"

    def wait_closed(self) -> None:
        assert self._proc.stdout is not None and self._proc.stdout.readline() == "closed\n"

    def heard(self) -> str:
        out, _ = self._proc.communicate(timeout=30)
        return out

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


@pytest.fixture
def squatter() -> Iterator[Squatter]:
    assert os.geteuid() == 0, "the squatter runs as another uid: the suite runs as root"
    squatter = Squatter()
    yield squatter
    squatter.kill()


def _with_client(address: str, ns: Namespace) -> str:
    async def go() -> None:
        async with KVStoreClient(address, ns, token=ALICE, timeout_s=2):
            pass
    return _refusal(lambda: asyncio.run(go()))


def _with_ctl(address: str, ns: Namespace) -> str:
    """kvstore-ctl's exit status and stderr (where it says why it failed)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = ctl.main(["--server", address, "--token", ALICE, "--timeout", "2", "stats"])
    return f"exit {status}: {err.getvalue()}"


def _with_call_metadata(address: str, ns: Namespace) -> str:
    """A channel whose caller adds the token to each call (kvstore-bench fuzz)."""
    async def go() -> None:
        async with aio_channel(address, per_call_tokens=True) as channel:
            await channel.unary_unary("/kvstore.v1.Directory/Stats")(b"", timeout=2, metadata=call_metadata(ALICE))
    return _refusal(lambda: asyncio.run(go()))


def _refusal(call: Callable[[], object]) -> str:
    """What the client said when ``call`` failed (kvstore-ctl: its stderr line)."""
    try:
        result = call()
    except (Unauthenticated, grpc.RpcError) as exc:
        return str(exc.details() if isinstance(exc, grpc.RpcError) else exc)
    except Exception as exc:  # noqa: BLE001 - any other failure is reported by the caller's assertion
        return f"{type(exc).__name__}: {exc}"
    return f"no refusal: {result!r}"


CLIENTS = [_with_client, _with_ctl, _with_call_metadata]


@pytest.mark.parametrize("client", CLIENTS, ids=["KVStoreClient", "kvstore-ctl", "per-call-metadata"])
def test_no_token_goes_to_a_loopback_port_another_uid_listens_on(squatter: Squatter, ns: Namespace, client) -> None:
    """Bug: a token went in clear text to whatever listened on the loopback address."""
    said = client(squatter.address, ns)
    assert ALICE not in squatter.heard(), "the token reached a listener of another uid"
    assert squatter.address in said and "uid 65534" in said and "withheld" in said, said


def test_an_accepted_connection_another_uid_keeps_on_the_port_withholds_the_token(ns: Namespace) -> None:
    """Another uid's listener connected gRPC to itself, then closed and let the real server bind
    again, keeping the connection: a listener check alone would hand the token to that connection."""
    squatter = Squatter(mode="linger")
    try:
        with socket.create_connection(("127.0.0.1", squatter.port)), socket.socket() as ours:
            squatter.wait_closed()
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ours.bind(("127.0.0.1", squatter.port))
            ours.listen(8)  # this uid's listener: the only one on the port
            said = _with_ctl(squatter.address, ns)
        assert "uid 65534" in said and "withheld" in said, said
    finally:
        squatter.kill()


def test_without_netlink_the_proc_socket_table_decides(squatter: Squatter, ns: Namespace,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(socket, "AF_NETLINK")  # as where no sock_diag dump is allowed
    said = _with_client(squatter.address, ns)
    assert ALICE not in squatter.heard()
    assert "uid 65534" in said and "withheld" in said, said


def test_a_client_that_cannot_tell_who_listens_sends_no_token(squatter: Squatter, ns: Namespace,
                                                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fail closed (no netlink, no /proc/net: not Linux): the refusal says to use TLS."""
    monkeypatch.delattr(socket, "AF_NETLINK")
    monkeypatch.setattr(loopback_owner, "PROC_NET", tmp_path / "no-proc-net")
    said = _with_client(squatter.address, ns)
    assert ALICE not in squatter.heard()
    assert "cannot tell" in said and "TLS" in said and squatter.address in said, said


async def test_a_token_on_loopback_reaches_a_server_of_this_uid(server_factory, tmp_path: Path, layout, ns,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The normal case: this uid's server, its auth file, tokens in clear text on loopback."""
    server = server_factory(secure_config(tmp_path, auth_file=write_auth_file(tmp_path / "auth.json", grants())))
    tokens = list(range(2 * layout.page_tokens))
    async with KVStoreClient(server.address, ns, token=ALICE) as client:
        assert await client.put(tokens, random_kv(layout, len(tokens))) == len(tokens)
        assert (await client.lookup(tokens)).num_tokens == len(tokens)
    assert await asyncio.to_thread(ctl.main, ["--server", server.address, "--token", ADMIN, "--json", "stats"]) == 0
    assert '"node": "local"' in capsys.readouterr().out
