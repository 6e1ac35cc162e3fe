"""A TCP proxy a test can cut: a node that reaches etcd through it loses etcd (a network
partition of that node alone) while the rest of the cluster keeps it. With ``flip_at`` it
also flips one bit of what the upstream sends, at that offset of each connection's stream:
what a faulty NIC, switch or proxy does to bytes in flight, which TCP's own 16-bit checksum
can miss (the data planes' in-flight damage tests). ``hold()`` delays what the upstream sends
until ``release()``: a node whose etcd watch lags (its requests still reach etcd)."""

from __future__ import annotations

import socket
import threading

from support.etcd_proc import free_port


class TcpProxy:
    """127.0.0.1:``port`` -> ``upstream``. ``cut()`` closes every connection and refuses new ones
    until ``restore()``; ``hold()`` keeps the upstream's bytes back until ``release()``."""

    def __init__(self, upstream: tuple[str, int], flip_at: int | None = None) -> None:
        self.upstream, self.flip_at = upstream, flip_at
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._cut = False
        self._closed = False
        self._flowing = threading.Event()  # cleared: what the upstream sends waits
        self._flowing.set()
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
            for src, dst, flip_at, gate in ((client, server, None, None), (server, client, self.flip_at, self._flowing)):
                threading.Thread(target=self._pump, args=(src, dst, flip_at, gate), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, flip_at: int | None, gate: threading.Event | None) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if gate is not None:
                    gate.wait()
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

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        self.cut()
        self._listener.close()
