"""kvstore-pd-proxy in front of two small HTTP servers that answer as a prefill and a decode
``vllm serve`` do (a real pair costs CI two more engines; tests/client/adapters/test_vllm_pd.py
runs the connector's side of the same exchange on real engines): what each instance is
sent, and that the decode's answer reaches the client whole, streamed or not."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvstore.cli.pd_proxy import Backend, ProxyConfig, ProxyServer

HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": "ab" * 16,
           "kvstore_prefill_node": "np", "kvstore_decode_node": "nd", "kvstore_num_tokens": 128}


class Instance(ThreadingHTTPServer):
    """A vllm serve stand-in: records each request body; ``role`` says how it answers."""

    daemon_threads = True

    def __init__(self, role: str) -> None:
        super().__init__(("127.0.0.1", 0), InstanceHandler)
        self.role = role
        self.bodies: list[dict[str, Any]] = []
        self.fail = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class InstanceHandler(BaseHTTPRequestHandler):
    server: Instance

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.bodies.append(body)
        if self.server.fail:
            self._send(500, b'{"error": "boom"}', "application/json")
        elif self.server.role == "prefill":
            self._send(200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": HANDOFF}).encode(), "application/json")
        elif body.get("stream"):
            events = b"".join(b"data: %s\n\n" % json.dumps({"choices": [{"text": t}]}).encode() for t in "abc")
            self._send(200, events + b"data: [DONE]\n\n", "text/event-stream")
        else:
            self._send(200, json.dumps({"choices": [{"text": "abc"}], "seen": body.get("kv_transfer_params")}).encode(),
                       "application/json")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def instances() -> Iterator[dict[str, Instance]]:
    started = {role: Instance(role) for role in ("prefill", "decode")}
    for server in started.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield started
    for server in started.values():
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(instances: dict[str, Instance]) -> Iterator[int]:
    config = ProxyConfig([Backend(instances["prefill"].url)], [Backend(instances["decode"].url, "nd")], timeout_s=30)
    server = ProxyServer(("127.0.0.1", 0), config)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type", ""), resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_then_decode_with_the_handoff(instances: dict[str, Instance], proxy: int, path: str) -> None:
    request = {"model": "m", "prompt": "hello", "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
    status, kind, data = post(proxy, path, request)
    assert status == 200 and kind == "text/event-stream"
    assert data.count(b"data: ") == 4 and data.endswith(b"data: [DONE]\n\n")
    (sent_prefill,), (sent_decode,) = instances["prefill"].bodies, instances["decode"].bodies
    assert sent_prefill["max_tokens"] == 1 and "stream" not in sent_prefill and "stream_options" not in sent_prefill
    assert sent_prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                  "kvstore_decode_node": "nd"}
    assert sent_decode == {**request, "kv_transfer_params": HANDOFF}


def test_a_failed_prefill_leaves_the_prompt_to_the_decode(instances: dict[str, Instance], proxy: int) -> None:
    instances["prefill"].fail = True
    status, _, data = post(proxy, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 4})
    assert status == 200 and json.loads(data) == {"choices": [{"text": "abc"}], "seen": None}
    assert "kv_transfer_params" not in instances["decode"].bodies[0]


def test_help_shows_the_defaults() -> None:
    done = subprocess.run([sys.executable, "-m", "kvstore.cli.pd_proxy", "--help"], capture_output=True, text=True,
                          timeout=60, check=True)
    assert "--decode-node" in done.stdout and "(default: 8000)" in done.stdout
