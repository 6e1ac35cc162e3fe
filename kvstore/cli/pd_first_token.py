"""The first token is the prefill's: how ``kvstore-pd-proxy`` serves ``/v1/completions`` (DESIGN §12.7).

More: kvstore/cli/README.md (### pd_first_token.py).
"""

from __future__ import annotations

import json
from typing import Any

from kvstore.cli.pd_fields import COMPLETIONS_MAX_TOKENS, as_int, one_token

# fields whose values never depend on which engine samples which token (the prompt fields:
# the decode gets token ids); any other field, or another value, goes today's way
FREE_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
    "stream_options", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "repetition_penalty", "logit_bias", "allowed_token_ids", "user", "request_id",
    "return_token_ids", "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "cache_salt", "priority",
    "kv_transfer_params", "echo", "n", "logprobs", "prompt_logprobs", "frequency_penalty", "presence_penalty",
    "bad_words", "use_beam_search",
})
DROPPED_FOR_DECODE = ("truncate_prompt_tokens", "truncation_side", "add_special_tokens")  # it gets token ids
FLAGS = ("stream", "return_token_ids")  # read here; a value vLLM coerces ("false") goes today's way


def _flag(value: Any) -> bool:
    """Whether vLLM and a Python truth test read ``value`` alike (a JSON boolean or null)."""
    return value is None or type(value) is bool


def eligible(body: dict[str, Any]) -> bool:
    """True when the prefill's first token may be the client's (see the module docstring), of a
    request ``pd_fields.splittable`` takes."""
    if set(body) - FREE_FIELDS or not all(_flag(body.get(f)) for f in FLAGS):
        return False
    prompt = body.get("prompt")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt))):
        return False  # a batch of prompts, or none
    max_tokens = body.get("max_tokens", COMPLETIONS_MAX_TOKENS)
    if type(max_tokens) is not int or max_tokens < 1:  # null: 16 or the context's room by vLLM version; decode's call
        return False
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or options.get("continuous_usage_stats") or not _flag(options.get("include_usage")):
        return False
    seeded = body.get("seed") is not None and body.get("temperature") != 0
    return not (seeded or body.get("echo") or body.get("n", 1) not in (1, None) or body.get("logprobs") is not None
                or body.get("prompt_logprobs") is not None or body.get("frequency_penalty") or body.get("presence_penalty")
                or body.get("stop") or body.get("bad_words") or body.get("use_beam_search"))


def prefill_body(body: dict[str, Any], transfer: dict[str, Any] | None) -> dict[str, Any]:
    """The prefill's request: the client's sampling, one token, not streamed, with its token ids;
    ``transfer``: the handoff asked for (None when the answer is the whole request)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "kv_transfer_params")}
    out |= one_token(body) | {"return_token_ids": True}
    if transfer is not None:
        out["kv_transfer_params"] = transfer
    return out


def first_token(answer: dict[str, Any]) -> tuple[list[int], int, str, str | None] | None:
    """(prompt token ids, the first token, its text, finish reason) of a prefill's answer; None
    when it has no usable token (the request then goes today's way)."""
    try:
        (choice,) = answer["choices"]
        (token,) = choice["token_ids"]
        prompt, text, finish = choice["prompt_token_ids"], choice["text"], choice.get("finish_reason")
    except (KeyError, TypeError, ValueError):
        return None
    if type(token) is not int or not isinstance(prompt, list) or not isinstance(text, str):
        return None
    return prompt, token, text, finish


def ends_at_first(body: dict[str, Any], finish: str | None) -> bool:
    """Whether the first token ended the client's request (eos, a stop token, max_tokens 1)."""
    return finish not in (None, "length") or body.get("max_tokens", COMPLETIONS_MAX_TOKENS) == 1


def decode_body(body: dict[str, Any], prompt: list[int], token: int, params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode's request: the prompt and the first token as token ids, one token less to make."""
    out = {k: v for k, v in body.items() if k not in DROPPED_FOR_DECODE and k != "kv_transfer_params"}
    out["prompt"] = [*prompt, token]
    out["max_tokens"] = body.get("max_tokens", COMPLETIONS_MAX_TOKENS) - 1
    least = as_int(body.get("min_tokens"))
    if least:  # "3" as vLLM reads it
        out["min_tokens"] = least - 1
    if params:
        out["kv_transfer_params"] = params
    return out


def answer(body: dict[str, Any], prefill: dict[str, Any]) -> dict[str, Any]:
    """A prefill's answer as the client's whole answer (its first token ended the request)."""
    out = dict(prefill, kv_transfer_params=None) if "kv_transfer_params" in prefill else dict(prefill)
    if not body.get("return_token_ids"):
        out["choices"] = [{**c, "prompt_token_ids": None, "token_ids": None} for c in out["choices"]]
    return out


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The decode's usage as the client's: its prompt's last token was the first output token."""
    if not usage:
        return usage
    return {**usage, "prompt_tokens": usage["prompt_tokens"] - 1, "completion_tokens": usage["completion_tokens"] + 1}


def merged(body: dict[str, Any], prompt: list[int], token: int, text: str, decode: dict[str, Any]) -> dict[str, Any]:
    """The decode's whole answer with the first token put in front (a request not streamed)."""
    out = dict(decode, usage=_usage(decode.get("usage")))
    choices = []
    for choice in decode["choices"]:
        choice = dict(choice, text=text + choice["text"])
        if body.get("return_token_ids"):
            choice |= {"prompt_token_ids": prompt, "token_ids": [token, *(choice.get("token_ids") or [])]}
        choices.append(choice)
    out["choices"] = choices
    return out


def first_event(body: dict[str, Any], prefill: dict[str, Any], prompt: list[int], token: int, text: str,
                finish: str | None) -> bytes:
    """The stream's first event: the prefill's token, as vLLM streams a token."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                              "stop_reason": prefill["choices"][0].get("stop_reason") if finish else None}
    if body.get("return_token_ids"):
        choice |= {"prompt_token_ids": prompt, "token_ids": [token]}
    chunk = {"id": prefill.get("id"), "object": "text_completion", "created": prefill.get("created"),
             "model": prefill.get("model"), "choices": [choice]}
    return b"data: %s\n\n" % json.dumps(chunk).encode()


def usage_event(prefill: dict[str, Any]) -> bytes:
    """The last event of a stream the first token ended, when the client asked for usage."""
    chunk = {"id": prefill.get("id"), "object": "text_completion", "created": prefill.get("created"),
             "model": prefill.get("model"), "choices": [],
             "usage": {k: v for k, v in (prefill.get("usage") or {}).items() if v is not None}}  # vLLM leaves out nulls here
    return b"data: %s\n\n" % json.dumps(chunk).encode()


def relayed_line(line: bytes, stream_id: str | None) -> bytes:
    """One line of the decode's stream as the client's: the first event's id, the decode's
    prompt ids left out (the first event carried the client's), usage counted as colocated."""
    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
        return line
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return line
    if not isinstance(chunk, dict) or "choices" not in chunk:
        return line  # an error event
    chunk["id"] = stream_id
    for choice in chunk["choices"]:
        if choice.get("prompt_token_ids") is not None:
            choice["prompt_token_ids"] = None
    if chunk.get("usage"):
        chunk["usage"] = _usage(chunk["usage"])
    return b"data: %s\n" % json.dumps(chunk).encode()
