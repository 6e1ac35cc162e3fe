"""Page keys: deterministic across processes and machines, chained, full pages only."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvstore import KVLayout, Namespace
from kvstore.errors import ConfigError, InvalidRequest
from kvstore.keys import page_keys

QWEN3_8B = KVLayout(36, 8, 128, dtype="bfloat16", page_tokens=16)


def test_pinned_digests() -> None:
    """A change of the key format must be deliberate: these digests are fixed."""
    ns = Namespace(model="Qwen/Qwen3-8B", revision="abc", layout=QWEN3_8B)
    assert ns.namespace_id.hex() == "d814f4452bf0e529f66002b5685fe4b3"
    keys = page_keys(ns.namespace_id, list(range(40)), 16)
    assert [k.hex() for k in keys] == ["6741934c0652579bdc8814f90231ab8d", "d49ad7e8ad6eb500b1d1c4924c3b1769"]


def test_keys_equal_in_another_process() -> None:
    code = (
        "from kvstore import KVLayout, Namespace; from kvstore.keys import page_keys;"
        "ns = Namespace(model='m', revision='r', layout=KVLayout(4, 2, 64, dtype='float16'));"
        "print(','.join(k.hex() for k in page_keys(ns.namespace_id, list(range(5000, 5100)), 16)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    ns = Namespace(model="m", revision="r", layout=KVLayout(4, 2, 64, dtype="float16"))
    assert out.split(",") == [k.hex() for k in page_keys(ns.namespace_id, list(range(5000, 5100)), 16)]


def test_only_full_pages_and_chain() -> None:
    ns = Namespace(model="m", revision="r", layout=QWEN3_8B)
    assert len(page_keys(ns.namespace_id, list(range(1024)), 16)) == 64
    assert len(page_keys(ns.namespace_id, list(range(1023)), 16)) == 63
    assert page_keys(ns.namespace_id, list(range(15)), 16) == []
    a = page_keys(ns.namespace_id, [1] * 16 + [2] * 16, 16)
    b = page_keys(ns.namespace_id, [3] * 16 + [2] * 16, 16)
    assert a[1] != b[1], "the same page after a different prefix must get another key"
    assert page_keys(ns.namespace_id, np.arange(64), 16) == page_keys(ns.namespace_id, list(range(64)), 16)


@pytest.mark.parametrize(
    "change",
    [
        {"revision": "r2"}, {"adapter": "lora-a"}, {"tenant_salt": "t2"}, {"tp_rank": 1, "tp_size": 2},
        {"layout": KVLayout(36, 8, 128, dtype="float16")}, {"layout": KVLayout(36, 8, 128, dtype="bfloat16", page_tokens=32)},
    ],
)
def test_namespace_fields_change_the_id(change: dict) -> None:
    base = {"model": "m", "revision": "r", "layout": QWEN3_8B}
    assert Namespace(**base).namespace_id != Namespace(**{**base, **change}).namespace_id


def test_bad_tokens_and_layouts_are_clear_errors() -> None:
    ns = Namespace(model="m", revision="r", layout=QWEN3_8B)
    with pytest.raises(InvalidRequest, match="token ids"):
        page_keys(ns.namespace_id, [-1] * 16, 16)
    with pytest.raises(InvalidRequest, match="integers"):
        page_keys(ns.namespace_id, [0.5] * 16, 16)
    with pytest.raises(ConfigError, match="num_layers"):
        KVLayout(0, 8, 128)
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(1, 8, 128, dtype="complex64")


def test_layout_sizes_match_the_chapter() -> None:
    assert QWEN3_8B.bytes_per_token == 144 * 1024
    assert QWEN3_8B.page_bytes == 2_359_296
    assert QWEN3_8B.bytes_per_token * 8192 == 1_207_959_552
    mla = KVLayout(61, 1, 576, dtype="bfloat16", attention="mla")
    assert mla.bytes_per_token == 70_272
