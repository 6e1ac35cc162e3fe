"""kvstore/cli/pd_fields.py: what the proxy reads in an int field is what vLLM's request validation
(pydantic, lax) reads, or nothing (the request then goes to the decode as sent)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstore.cli.pd_fields import as_int, splittable

VALUES = [3, -3, 0, "3", "+3", "-3", "03", 3.0, 3.5, " 3", "3.0", "1_000", "0x10", "3e0", "", "٣", True, None,
          [3], {"n": 3}, "9" * 5000, 1e300, 10**30]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_an_int_read_here_is_the_one_vllm_reads(value: Any) -> None:
    pydantic = pytest.importorskip("pydantic")
    got = as_int(value)
    if got is None:
        return  # the request goes to vLLM as sent
    assert got == pydantic.TypeAdapter(int).validate_json(json.dumps(value))


@pytest.mark.parametrize(("body", "chat", "split"), [
    ({"max_tokens": 8, "min_tokens": "3"}, False, True),
    ({"min_tokens": 16}, False, True),  # a completion's max_tokens: 16 when absent
    ({"min_tokens": 17}, False, False),
    ({"max_tokens": None, "min_tokens": 17}, False, False),
    ({"min_tokens": 17}, True, True),  # a chat's: the context's room, which only vLLM knows
    ({"max_completion_tokens": 4, "max_tokens": 9, "min_tokens": 5}, True, False),
    ({"max_tokens": 0}, False, False),
    ({"max_completion_tokens": "x"}, True, False),
    ({"min_tokens": None}, False, False),
    ({"stream": "true"}, False, False),
    ({"stream": True, "stream_options": {"include_usage": True}}, False, True),
    ({"stream_options": {"include_usage": True}}, False, False),
    ({"stream": True, "stream_options": "x"}, False, False),
    ({"stream_options": {}}, False, True),
    ({"n": 2}, False, False),  # a handoff per sample, the decode reads one
    ({"n": "1", "prompt": [1, 2, 3]}, False, True),
    ({"prompt": ["a", "b"]}, False, False),  # a handoff per prompt
    ({"prompt": [[1, 2], [3]]}, False, False),
    ({"n": 3}, True, False),
])
def test_splittable(body: dict[str, Any], chat: bool, split: bool) -> None:
    assert splittable(body, chat) is split
