"""Bad client arguments fail at construction with a clear InvalidRequest, not later as an
obscure connection failure: every call has a deadline (client.py), so ``timeout_s`` must be a
finite number of seconds above zero (``inf`` once made a client that could not connect)."""

from __future__ import annotations

import math

import pytest
import torch

from kvstore import KVLayout, Namespace
from kvstore.client import KVStoreClient
from kvstore.errors import InvalidRequest

NS = Namespace(model="args", revision="r1", layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16))


@pytest.mark.parametrize("timeout_s", [math.inf, math.nan, 0.0, -1.0])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_at_construction(timeout_s: float) -> None:
    with pytest.raises(InvalidRequest, match="timeout_s"):
        KVStoreClient("127.0.0.1:1", NS, timeout_s=timeout_s)


def test_a_finite_timeout_is_taken() -> None:
    assert KVStoreClient("127.0.0.1:1", NS, timeout_s=0.5).timeout_s == 0.5
