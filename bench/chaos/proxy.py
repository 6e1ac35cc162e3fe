"""A TCP proxy a fault can cut or hold: put between a node and etcd, cutting it partitions
that node alone from etcd and holding it makes its watch and lease answers lag; put before a
node's advertised address, holding it makes the node slow to every peer (a slow data link).
The idea of tests/support/tcp_proxy.py, which bench code cannot import."""

from __future__ import annotations

import socket
import threading

from kvstore.bench.common.harness import free_port


class Proxy:
    """127.0.0.1:``port`` -> ``upstream``. ``cut()`` closes every connection and refuses new
    ones until ``restore()``; ``hold()`` keeps what the upstream sends back until ``release()``
    (what the downstream sends still reaches the upstream). Thread-safe."""

    def __init__(self, upstream: tuple[str, int], port: int | None = None) -> None:
        self.upstream = upstream
        self.port = port or free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._cut = False
        self._closed = False
        self._flowing = threading.Event()  # cleared: what the upstream sends waits
        self._flowing.set()
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refused = self._cut or self._closed
            if refused:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self._flowing), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gate: threading.Event | None) -> None:
        try:
            while data := src.recv(65536):
                if gate is not None:
                    gate.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                for s in (src, dst):
                    if s in self._open:
                        self._open.remove(s)
                        s.close()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            sockets, self._open = self._open, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def heal(self) -> None:
        """Whatever fault is on: flowing and open again."""
        self.release()
        self.restore()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._flowing.set()
        self.cut()
        self._listener.close()
