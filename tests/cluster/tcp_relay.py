"""A test-only relay between a page fetcher and a TCP page server that flips one byte of
what the server sends (at a fixed offset of each connection's stream): what a faulty NIC,
switch or proxy does to bytes in flight, which TCP's own 16-bit checksum can miss."""

from __future__ import annotations

import socket
import threading


class FlippingRelay:
    def __init__(self, upstream: tuple[str, int], flip_at: int) -> None:
        self.upstream, self.flip_at = upstream, flip_at
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                return
            server.settimeout(None)
            self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.flip_at), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
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

    def close(self) -> None:
        self._listener.close()
        for s in self._open:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
