"""The request fields kvstore-pd-proxy rewrites, read as vLLM's request validation takes them (DESIGN §12.7).

A request is split (a one-token prefill, then the decode) only when each field the proxy
rewrites holds a value vLLM takes; any other request goes to the decode as sent, so that vLLM
answers it (a 400, most often) and no handoff is opened that no decode would consume.

More: kvstore/cli/README.md (### pd_fields.py).
"""

from __future__ import annotations

import re
from typing import Any

COMPLETIONS_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens when absent or null
_INT = re.compile(r"[+-]?[0-9]+")


def as_int(value: Any) -> int | None:
    """``value`` as vLLM takes an int field (pydantic, lax): an int, a float without a fraction,
    a string of ASCII digits ("3"); None otherwise, also for a few that pydantic takes (true,
    " 3", "1_000"), whose requests then go to the decode as sent."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, str) and _INT.fullmatch(value) and len(value) <= 19:
        return int(value)
    return None


def _max_tokens(body: dict[str, Any], chat: bool) -> tuple[bool, int | None]:
    """(whether the token limits are ones vLLM takes, the limit: None for none given to a chat)."""
    fields = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)  # vLLM's order
    given = [as_int(body[f]) for f in fields if body.get(f) is not None]
    if any(n is None or n < 1 for n in given):
        return False, None
    return True, given[0] if given else (None if chat else COMPLETIONS_MAX_TOKENS)


def splittable(body: dict[str, Any], chat: bool) -> bool:
    """Whether vLLM takes the fields a prefill's request changes: ``max_tokens`` (and
    ``max_completion_tokens``) >= 1, ``min_tokens`` between 0 and that limit, ``stream`` a
    boolean, ``stream_options`` an object and only with ``stream`` true; one prompt, one sample
    (``_one_sequence``). A value vLLM would
    refuse (or one read here more strictly than vLLM does) sends the request to the decode as sent."""
    ok, limit = _max_tokens(body, chat)
    if not ok or not _one_sequence(body, chat):
        return False
    if "min_tokens" in body:
        least = as_int(body["min_tokens"])
        if least is None or least < 0 or (limit is not None and least > limit):
            return False
    if body.get("stream") is not None and type(body["stream"]) is not bool:
        return False
    options = body.get("stream_options")
    return not options or (isinstance(options, dict) and body.get("stream") is True)


def _one_sequence(body: dict[str, Any], chat: bool) -> bool:
    """One prompt, one sample: the prefill's answer names one handoff. A batch of prompts or
    ``n`` > 1 made the prefill open one a prompt or sample, of which the decode could read one
    (the rest pinned at the node until the ttl): such a request goes to the decode as sent."""
    if body.get("n") is not None and as_int(body["n"]) != 1:
        return False
    prompt = body.get("prompt")
    return chat or prompt is None or isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))


def one_token(body: dict[str, Any]) -> dict[str, Any]:
    """The fields that make a ``splittable`` request a one-token one (the prefill's): vLLM refuses
    ``min_tokens`` above ``max_tokens``, so it is lowered to 1."""
    out: dict[str, Any] = {"max_tokens": 1}
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    least = as_int(body.get("min_tokens"))
    if least is not None and least > 1:
        out["min_tokens"] = 1
    return out
