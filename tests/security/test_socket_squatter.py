"""A same-host client hands its bearer token only to a socket served by its own uid (or
root): a process of another uid that can write into the server's data directory (modes set
wrong) and puts its own socket at the call or arena socket's path must not harvest tokens.

Runs the squatter as uid 65534 (nobody): the suite runs as root, as CI does."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from kvstore.callsocket import frames
from kvstore.callsocket.client_sync import CallChannel
from kvstore.errors import KVStoreError
from kvstore.security.arena_socket import receive_arena

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # the squatter's: stdlib only, and nobody may run it (the venv's may be under /root)
TOKEN = "the-tenants-secret-token"

SQUATTER = """
import os, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
os.umask(0)
sock.bind(sys.argv[1])
sock.listen(1)
print("listening", flush=True)
conn, _ = sock.accept()
conn.settimeout(3)
got = b""
try:
    while chunk := conn.recv(4096):
        got += chunk
except OSError:
    pass
print(repr(got), flush=True)
"""


def _squat(path: Path) -> subprocess.Popen[str]:
    squatter = subprocess.Popen([SYSTEM_PYTHON, "-c", SQUATTER, str(path)], user=NOBODY, stdout=subprocess.PIPE, text=True)
    assert squatter.stdout is not None and squatter.stdout.readline() == "listening\n"
    return squatter


def _heard(squatter: subprocess.Popen[str]) -> str:
    out, _ = squatter.communicate(timeout=30)
    return out


def test_no_token_goes_to_a_socket_of_another_uid() -> None:
    assert os.geteuid() == 0, "the squatter runs as another uid: the suite runs as root"
    directory = Path(tempfile.mkdtemp(prefix="kvstore-squat-"))
    try:
        directory.chmod(0o777)  # a data directory with the wrong modes
        call_path, arena_path = directory / "call.sock", directory / "arena.sock"
        squatter = _squat(call_path)
        assert CallChannel.open(str(call_path), TOKEN, b"\0" * frames.CALL_TOKEN_BYTES, 2.0) is None
        assert TOKEN not in _heard(squatter), "the call channel sent its token to another uid's socket"
        squatter = _squat(arena_path)
        try:
            receive_arena(arena_path, TOKEN, timeout_s=2.0)
        except KVStoreError:
            pass
        assert TOKEN not in _heard(squatter), "the arena client sent its token to another uid's socket"
    finally:
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()
