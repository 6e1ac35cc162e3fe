"""kvstore-pd-proxy in front of two small HTTP servers that answer as a prefill and a decode
``vllm serve`` do (tests/client/adapters/test_vllm_pd.py runs the connector's side of the same
exchange on real engines, test_vllm_pd_proxy.py the proxy's answers against a real ``vllm
serve``'s): what each instance is sent, and what reaches the client, streamed or not."""

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

PROMPT_IDS = [5, 6, 7]
FIRST = {"token_ids": [9], "text": "x", "prompt_token_ids": PROMPT_IDS, "finish_reason": "length", "stop_reason": None}
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
        self.first = dict(FIRST)  # the prefill's choice (its first token)

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
            answer = {"id": "cmpl-p", "choices": [dict(self.server.first, index=0)], "kv_transfer_params": HANDOFF,
                      "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
            self._send(200, json.dumps(answer).encode(), "application/json")
        elif body.get("stream"):
            events = [{"id": "cmpl-d", "choices": [{"index": 0, "text": t, "token_ids": [i], "prompt_token_ids": body.get("prompt") if i == 0 else None}]}
                      for i, t in enumerate("abc")]
            events.append({"id": "cmpl-d", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}})
            data = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events)
            self._send(200, data + b"data: [DONE]\n\n", "text/event-stream")
        else:
            answer = {"id": "cmpl-d", "choices": [{"index": 0, "text": "abc", "token_ids": [0, 1, 2], "finish_reason": "length"}],
                      "seen": body.get("kv_transfer_params"), "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
            self._send(200, json.dumps(answer).encode(), "application/json")

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


def events(data: bytes) -> list[dict[str, Any]]:
    assert data.endswith(b"data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]


def test_a_chat_goes_to_the_decode_whole_with_the_handoff(instances: dict[str, Instance], proxy: int) -> None:
    """A chat's first token is not the prefill's (pd_first_token.py): the decode gets the request
    with the handoff and samples it, its answer relayed as it comes."""
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True,
               "stream_options": {"include_usage": True}}
    status, kind, data = post(proxy, "/v1/chat/completions", request)
    assert status == 200 and kind == "text/event-stream" and [e["id"] for e in events(data)] == ["cmpl-d"] * 4
    (sent_prefill,), (sent_decode,) = instances["prefill"].bodies, instances["decode"].bodies
    assert sent_prefill["max_tokens"] == 1 and "stream" not in sent_prefill and "stream_options" not in sent_prefill
    assert sent_prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                  "kvstore_decode_node": "nd"}
    assert sent_decode == {**request, "kv_transfer_params": HANDOFF}


def test_a_streamed_completions_first_token_is_the_prefills(instances: dict[str, Instance], proxy: int) -> None:
    """The prefill's token is the stream's first event; the decode gets the prompt's token ids and
    that token, one token less to make, and the handoff; its events follow under the same id,
    its prompt ids left out, usage counted as a colocated engine's (3 prompt + 4 generated)."""
    request = {"model": "m", "prompt": "hello", "max_tokens": 16, "temperature": 0, "stream": True, "return_token_ids": True,
               "stream_options": {"include_usage": True}}
    status, kind, data = post(proxy, "/v1/completions", request)
    assert status == 200 and kind == "text/event-stream"
    got = events(data)
    assert [c["text"] for e in got for c in e["choices"]] == ["x", "a", "b", "c"] and {e["id"] for e in got} == {"cmpl-p"}
    assert [t for e in got for c in e["choices"] for t in c["token_ids"]] == [9, 0, 1, 2]
    assert [c["prompt_token_ids"] for e in got for c in e["choices"]] == [PROMPT_IDS, None, None, None]
    assert got[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    (sent_prefill,), (sent_decode,) = instances["prefill"].bodies, instances["decode"].bodies
    assert sent_prefill == {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0, "return_token_ids": True,
                            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "kvstore_decode_node": "nd"}}
    assert sent_decode == {**request, "prompt": [*PROMPT_IDS, 9], "max_tokens": 15, "kv_transfer_params": HANDOFF}


def test_a_completion_not_streamed_gets_the_first_token_in_front(instances: dict[str, Instance], proxy: int) -> None:
    status, _, data = post(proxy, "/v1/completions", {"model": "m", "prompt": [5, 6, 7], "min_tokens": 3, "max_tokens": 4})
    answer = json.loads(data)
    assert status == 200 and answer["choices"][0]["text"] == "xabc" and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7} and answer["seen"] == HANDOFF
    (sent_decode,) = instances["decode"].bodies
    assert sent_decode["prompt"] == [*PROMPT_IDS, 9] and sent_decode["max_tokens"] == 3 and sent_decode["min_tokens"] == 2
    assert instances["prefill"].bodies[0]["min_tokens"] == 1 and "return_token_ids" not in sent_decode


@pytest.mark.parametrize("stream", [False, True])
def test_a_first_token_that_ends_the_request_makes_no_decode_request(instances: dict[str, Instance], proxy: int,
                                                                      stream: bool) -> None:
    """eos or a stop token: the prefill's answer is the client's (its handoff expires unused)."""
    instances["prefill"].first |= {"finish_reason": "stop", "stop_reason": 9}
    request = {"model": "m", "prompt": "hello", "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    status, _, data = post(proxy, "/v1/completions", request)
    assert status == 200 and not instances["decode"].bodies
    if stream:
        first, usage = events(data)
        assert first["choices"][0]["finish_reason"] == "stop" and first["choices"][0]["stop_reason"] == 9
        assert usage["usage"]["completion_tokens"] == 1
    else:
        answer = json.loads(data)
        assert answer["choices"][0]["text"] == "x" and answer["kv_transfer_params"] is None
        assert answer["choices"][0]["token_ids"] is None  # not asked for


def test_one_token_asked_is_the_prefills_answer_without_a_handoff(instances: dict[str, Instance], proxy: int) -> None:
    status, _, data = post(proxy, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 1})
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "x" and not instances["decode"].bodies
    assert "kv_transfer_params" not in instances["prefill"].bodies[0]


@pytest.mark.parametrize("case", ["stop strings", "empty text"])
def test_the_decode_samples_the_first_token_itself_when_the_prefills_cannot_be_shown(
        instances: dict[str, Instance], proxy: int, case: str) -> None:
    """Stop strings (one may span the first token and the next) and a first token without text
    (a partial character): the decode gets the original request and the handoff, as for a chat."""
    request = {"model": "m", "prompt": "hello", "max_tokens": 4}
    if case == "stop strings":
        request["stop"] = ["\n\n"]
    else:
        instances["prefill"].first["text"] = ""
    status, _, data = post(proxy, "/v1/completions", request)
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "abc"
    assert instances["decode"].bodies == [{**request, "kv_transfer_params": HANDOFF}]


def test_a_failed_prefill_leaves_the_prompt_to_the_decode(instances: dict[str, Instance], proxy: int) -> None:
    instances["prefill"].fail = True
    status, _, data = post(proxy, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 4})
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "abc" and json.loads(data)["seen"] is None
    assert "kv_transfer_params" not in instances["decode"].bodies[0]


def test_help_shows_the_defaults() -> None:
    done = subprocess.run([sys.executable, "-m", "kvstore.cli.pd_proxy", "--help"], capture_output=True, text=True,
                          timeout=60, check=True)
    assert "--decode-node" in done.stdout and "(default: 8000)" in done.stdout
