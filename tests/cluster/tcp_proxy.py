"""A TCP proxy a test can cut: a node that reaches etcd through it loses etcd (a network
partition of that node alone) while the rest of the cluster keeps it. With ``flip_at`` it
also flips one bit of what the upstream sends, at that offset of each connection's stream:
what a faulty NIC, switch or proxy does to bytes in flight, which TCP's own 16-bit checksum
can miss (the data planes' in-flight damage tests)."""

from __future__ import annotations

import socket
import threading

from etcd_proc import free_port


class TcpProxy:
    """127.0.0.1:``port`` -> ``upstream``. ``cut()`` closes every connection and refuses new ones
    until ``restore()``."""

    def __init__(self, upstream: tuple[str, int], flip_at: int | None = None) -> None:
        self.upstream, self.flip_at = upstream, flip_at
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._cut = False
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._cut or self._closed:
                    client.close()
                    continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, server]
            for src, dst, flip_at in ((client, server, None), (server, client, self.flip_at)):
                threading.Thread(target=self._pump, args=(src, dst, flip_at), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

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

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()
