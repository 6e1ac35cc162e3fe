"""The arena socket's client raises the class its server names, built from the message alone.
QuotaExceeded (9de152e) and HostQuotaFull cannot be built from a message: an answer naming one
makes receive_arena raise TypeError, not a KVStoreError ("Raises the server's error class ...,
or KVStoreError for a broken exchange")."""

from __future__ import annotations

import json
import socket
import struct
import threading
from pathlib import Path

import pytest

from kvstore import errors
from kvstore.security.arena_socket import receive_arena


@pytest.mark.parametrize("name", ["QuotaExceeded", "HostQuotaFull"])
def test_an_answer_naming_a_class_with_fields_is_still_a_kvstore_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / "arena.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(8192)
            body = json.dumps({"ok": False, "error": "refused", "error_class": name}).encode()
            conn.sendall(struct.pack(">I", len(body)) + body)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with pytest.raises(errors.KVStoreError):
            receive_arena(path, "token", timeout_s=5)
    finally:
        server.join(5)
        listener.close()
