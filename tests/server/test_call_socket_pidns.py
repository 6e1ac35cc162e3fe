"""A server in a pid namespace of its own (a container beside the engines' containers, the
call socket on a shared volume) sees every outside peer as pid 0 (SO_PEERCRED cannot name a
pid it has no number for): the per-process limit must not lump them all into one process,
or one engine's connections lock every other engine out of the call socket."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from support.servers import ServerProcess

from kvstore.callsocket import frames
from kvstore.callsocket.socket_server import CallSocket

CODES = {int(code.value[0]): code for code in grpc.StatusCode}
PER_PID = CallSocket.__init__.__kwdefaults__["max_per_pid"]  # type: ignore[index]


def _hello(path: Path) -> tuple[socket.socket, grpc.StatusCode]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    try:
        sock.sendall(frames.request_frame(frames.HELLO, 0, b""))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before the HELLO: the answer is there to read
    header = sock.recv(frames.ANSWER_HEADER.size, socket.MSG_WAITALL)
    _, status = frames.ANSWER_HEADER.unpack(header)
    return sock, CODES[status]


def test_peers_outside_the_servers_pid_namespace_are_not_one_process(tmp_path: Path) -> None:
    if subprocess.run(["unshare", "--pid", "--fork", "true"], check=False, capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not permitted here (no CAP_SYS_ADMIN)")
    server = ServerProcess(tmp_path)
    server.args = ["unshare", "--pid", "--kill-child", *server.args]  # the server dies with unshare
    server.start()
    try:
        path = tmp_path / "data" / "call.sock"
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        held = []
        for _ in range(PER_PID):  # one engine process at the per-process limit
            sock, status = _hello(path)
            assert status == grpc.StatusCode.OK, status
            held.append(sock)
        other = subprocess.run(  # another engine process
            [sys.executable, "-c", (f"import sys; sys.path[:0] = {sys.path!r}\n"
                                    "from test_call_socket_pidns import _hello\nfrom pathlib import Path\n"
                                    f"print(_hello(Path({str(path)!r}))[1].name)")],
            check=True, capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent)
        assert other.stdout.strip() == "OK", f"another process was refused: {other.stdout.strip()} {other.stderr[-500:]}"
        for sock in held:
            sock.close()
    finally:
        assert server.proc is not None
        children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
        server.kill()
        deadline = time.monotonic() + 10  # unshare's forked child, the server, ends with it (--kill-child)
        while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children and not any(Path(f"/proc/{pid}").exists() for pid in children), "the server outlived its test"
