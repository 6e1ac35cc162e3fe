"""kvstore-pd-proxy under request bodies vLLM itself answers but the proxy read otherwise: a
numeric string in an int field, a boolean field given as a string, a field value vLLM refuses,
a body that is not a JSON object. Through the proxy each gets the answer ``vllm serve`` gives
it directly, and no handoff is left pinned at the kvstore-server (kvstore/cli/pd_fields.py).

A real ``vllm serve`` (test_vllm_pd_proxy.serving) running the KVStoreConnector at a real
kvstore-server is both the prefill and the decode instance behind the real proxy."""

from __future__ import annotations

import http.client
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from support.servers import ServerProcess
from test_vllm_pd_proxy import serving
from test_vllm_pd_receive import assert_no_lease_left
from vllm_support import module_store

from kvstore.cli.pd_proxy import Backend, ProxyConfig, ProxyServer

__all__ = ["module_store"]  # the fixture "store"

pytestmark = pytest.mark.timeout(400)

# 81 tokens: a handoff of two whole pages (--block-size 32), pinned at the node until the decode reads it
BASE = {"model": "m", "prompt": "the quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, store: ServerProcess) -> Iterator[int]:
    """vllm serve with the KVStoreConnector at the module's kvstore-server (kv_both, recompute)."""
    transfer = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.client.adapters.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"address": store.address, "load_when_faster": False,
                                              "handoff_deadline_s": 10}}
    with serving(tmp_path_factory.mktemp("pd-bodies"), "--kv-transfer-config", json.dumps(transfer)) as port:
        yield port


@pytest.fixture(scope="module")
def proxy(serve: int) -> Iterator[int]:
    """The proxy, the server as its prefill and its decode (no decode node: found through the store)."""
    url = f"http://127.0.0.1:{serve}"
    server = ProxyServer(("127.0.0.1", 0), ProxyConfig([Backend(url)], [Backend(url)], timeout_s=60))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def answer(port: int, body: bytes | dict[str, Any]) -> tuple[int, str, Any]:
    """(status, content type, the answer: JSON without ids and times, or a stream's events so)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body if isinstance(body, bytes) else json.dumps(body).encode(),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        status, kind, data = resp.status, resp.getheader("content-type", ""), resp.read()
    except (http.client.RemoteDisconnected, ConnectionError) as exc:
        pytest.fail(f"no answer at all (the connection was dropped): {exc!r}")
    finally:
        conn.close()
    if kind.startswith("text/event-stream"):
        return status, kind, [{k: v for k, v in json.loads(line[6:]).items() if k not in ("id", "created")}
                              for line in data.split(b"\n") if line.startswith(b"data: {")]
    return status, kind, {k: v for k, v in json.loads(data).items() if k not in ("id", "created", "kv_transfer_params")}


@pytest.mark.parametrize("body", [b"[1, 2]", b"null", b'"text"', b"3", b"{"], ids=str)
def test_a_body_that_is_not_a_json_object_is_refused_as_vllm_refuses_it(serve: int, proxy: int, body: bytes) -> None:
    """A list, null, a string or a number: before, the proxy's handler raised AttributeError or
    TypeError and dropped the connection without an answer. Now it answers 400 in vLLM's error
    shape, as vLLM does; a body that is no JSON at all was a 400 of the proxy's own shape."""
    status, _, got = answer(proxy, body)
    want_status, _, want = answer(serve, body)
    assert status == want_status == 400, (status, got, want)
    assert set(got) == set(want) == {"error"} and set(got["error"]) == set(want["error"]), (got, want)
    assert got["error"]["code"] == 400 and got["error"]["message"], got


CASES = {
    # before: pd_first_token.decode_body computed "3" - 1 after the prefill handed off: TypeError,
    # no answer, and the handoff pinned at the node until its ttl
    "min_tokens as a string": {"min_tokens": "3"},
    # before: the decode was sent max_tokens null for the rest, which vLLM reads as 16: 17 tokens
    "max_tokens null": {"max_tokens": None},
    # before: a stream of events (the string is true), where vLLM answers one JSON object
    "stream as a string": {"stream": "false"},
    # before: the token ids in the answer (the string is true), where vLLM leaves them null
    "return_token_ids as a string": {"return_token_ids": "false"},
    # before: vLLM refused the old way's prefill (min_tokens 3 > max_tokens 1) and the decode
    # computed the whole prompt: such a request was never disaggregated (the proxy's warning)
    "old way, min_tokens": {"min_tokens": 3, "stop": ["zzz"]},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_vllm_takes_is_answered_as_vllm_answers_it(serve: int, proxy: int, store: ServerProcess, case: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Fields the proxy read as Python values where vLLM coerces them (pydantic, lax), or rewrote
    into a prefill request vLLM refuses (each case says what went wrong): the proxy's answer
    is the server's, its prefill is not refused, and no handoff is left pinned."""
    body = {**BASE, **CASES[case]}
    with caplog.at_level(logging.WARNING, logger="kvstore.cli.pd_proxy"):
        got = answer(proxy, body)
    assert got == answer(serve, body), case
    refused = [r.getMessage() for r in caplog.records if "answered" in r.getMessage()]
    assert not refused, f"the proxy's own prefill request was refused by vLLM: {refused}"
    assert_no_lease_left(store.address, within_s=5)


def test_min_tokens_0_as_a_string_lets_the_first_token_stop_the_request(serve: int, proxy: int) -> None:
    """``"min_tokens": "0"``: before, the proxy's prefill was sent min_tokens 1 (the string is
    true), which keeps a stop token from being the first: the prefill sampled another token where
    vLLM stops at once (and decode_body's "0" - 1 then raised TypeError: no answer). Here the server's own first token is made a stop token (a prompt of no
    whole page: a request the first token ends leaves its handoff to its ttl, pd_first_token.py)."""
    short = {**BASE, "prompt": "the quick brown fox jumps over the lazy dog"}
    first = answer(serve, {**short, "max_tokens": 1, "return_token_ids": True})[2]["choices"][0]["token_ids"][0]
    body = {**short, "min_tokens": "0", "stop_token_ids": [first]}
    want = answer(serve, body)
    assert want[2]["choices"][0]["finish_reason"] == "stop", want
    assert answer(proxy, body) == want


ONE_HANDOFF_EACH = {
    # before: the prefill opened a handoff per sample or prompt and answered one; the decode read
    # that one (a batch's other prompts recomputed), the others stayed pinned at the node to the ttl
    "n 2": {"n": 2, "temperature": 1.0, "seed": 5},
    "a batch of two prompts": {"prompt": [BASE["prompt"], BASE["prompt"].upper()]},
}


@pytest.mark.parametrize("case", list(ONE_HANDOFF_EACH))
def test_a_request_of_several_sequences_leaves_no_handoff_pinned(serve: int, proxy: int, store: ServerProcess,
                                                                 case: str) -> None:
    """Several samples (``n``) or prompts in one request: sent to the decode as they are (not split),
    vLLM's own answer, no handoff left at the node."""
    body = {**BASE, **ONE_HANDOFF_EACH[case]}
    got = answer(proxy, body)
    assert got == answer(serve, body), case
    assert got[0] == 200 and len(got[2]["choices"]) == 2, got
    assert_no_lease_left(store.address, within_s=5)


REFUSED = {
    "max_tokens 0": {"max_tokens": 0},
    "min_tokens above max_tokens": {"min_tokens": 9},
    "min_tokens negative": {"min_tokens": -1},
    "stream not a boolean": {"stream": "maybe"},
    "stream_options without stream": {"stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_request_vllm_refuses_gets_its_answer_and_opens_no_handoff(serve: int, proxy: int, store: ServerProcess,
                                                                      case: str) -> None:
    """A value vLLM refuses in a field the prefill's request changes: before, the prefill (sent
    max_tokens 1, min_tokens 1, not streamed) was taken and handed off, then the decode refused
    the request, so the handoff stayed pinned at the node until its ttl (and the answer to a
    min_tokens above max_tokens named the decode's max_tokens, one less). Now the request goes
    to the decode as sent: vLLM's own answer, no handoff."""
    body = {**BASE, **REFUSED[case]}
    want = answer(serve, body)
    assert want[0] == 400, want
    assert answer(proxy, body) == want
    assert_no_lease_left(store.address, within_s=5)
