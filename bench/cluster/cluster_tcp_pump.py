"""A bare TCP pump, the raw transport beside the TCP data plane's remote get in
``kvstore-bench cluster``: the same sockets (``kvstore.cluster.tcp_socket.tune``: cubic,
TCP_NODELAY, the same buffer sizes) and the same messages (page-sized, ``batch`` of them per
request), with nothing checked, framed or leased. The sender sends one page-sized buffer
from memory; the receiver ``recv_into``s a destination touched once beforehand, as the get's
host-arena slots and the engine's tensor are.

More: bench/cluster/README.md (### cluster_tcp_pump.py).
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from kvstore.cluster.tcp_socket import tune

_COUNT = struct.Struct("<Q")


def _serve(page_bytes: int) -> None:
    src = memoryview(np.random.default_rng(0).integers(0, 256, page_bytes, dtype=np.uint8)).cast("B")
    listener = socket.socket()
    tune(listener)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    print(listener.getsockname()[1], flush=True)

    def pump(conn: socket.socket) -> None:
        tune(conn)
        with conn:
            while len(head := conn.recv(_COUNT.size, socket.MSG_WAITALL)) == _COUNT.size:
                for _ in range(_COUNT.unpack(head)[0]):
                    conn.sendall(src)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=pump, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()  # until the parent closes stdin
    listener.close()


def _rounds(page_bytes: int, batch: int, total: int) -> None:
    server = subprocess.Popen([sys.executable, "-m", "kvstore.bench.cluster.cluster_tcp_pump", "--serve", str(page_bytes)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdin is not None
    port = int(server.stdout.readline())
    sock = socket.socket()
    tune(sock)
    sock.connect(("127.0.0.1", port))
    dest = np.zeros(batch * page_bytes, dtype=np.uint8)  # touched once, as a long-lived arena is
    pages = [memoryview(dest[i * page_bytes:(i + 1) * page_bytes]).cast("B") for i in range(batch)]

    def one_batch() -> None:
        sock.sendall(_COUNT.pack(batch))
        for page in pages:
            got = 0
            while got < page_bytes:
                n = sock.recv_into(page[got:], page_bytes - got, socket.MSG_WAITALL)
                if n == 0:
                    raise RuntimeError("the pump's sender closed the connection")
                got += n

    try:
        for line in sys.stdin:
            if line.strip() != "round":
                continue
            t0, moved = time.perf_counter(), 0
            while moved < total:
                one_batch()
                moved += batch * page_bytes
            print(f"gbps {moved / (time.perf_counter() - t0) / 1e9:.4f}", flush=True)
    finally:
        sock.close()
        server.stdin.close()
        server.wait(20)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _serve(int(sys.argv[2]))
    elif sys.argv[1] == "--rounds":
        _rounds(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
