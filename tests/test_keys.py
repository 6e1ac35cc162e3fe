"""Page keys: deterministic across processes and machines, chained, full pages only."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from kvstore import KVLayout, Namespace
from kvstore import keys as page_key_module
from kvstore.errors import ConfigError, InvalidRequest
from kvstore.keys import hashlib_keys, page_keys, token_array

QWEN3_8B = KVLayout(36, 8, 128, dtype="bfloat16", page_tokens=16)


def test_pinned_digests() -> None:
    """A change of the key format must be deliberate: these digests are fixed."""
    ns = Namespace(model="Qwen/Qwen3-8B", revision="abc", layout=QWEN3_8B)
    assert ns.namespace_id.hex() == "d814f4452bf0e529f66002b5685fe4b3"
    keys = page_keys(ns.namespace_id, list(range(40)), 16)
    assert [k.hex() for k in keys] == ["6741934c0652579bdc8814f90231ab8d", "d49ad7e8ad6eb500b1d1c4924c3b1769"]


@pytest.mark.parametrize("native", [True, False])
def test_pinned_digests_of_a_long_prefix(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned with the per-page hashlib loop (main 93ee59c) before the native chain: a 512-page
    prefix (the lookup benchmark's tokens) and 32-token pages holding the largest id; natively
    and with hashlib (a build without the extension)."""
    if native and page_key_module.chain_keys is None:
        pytest.skip("kvstore._keys was not built (no C compiler)")
    if not native:
        monkeypatch.setattr(page_key_module, "chain_keys", None)
    ns = Namespace(model="Qwen/Qwen3-8B", revision="abc", layout=QWEN3_8B)
    tokens = [(i * 7919) % 50_000 for i in range(512 * 16)]
    for form in (tokens, np.asarray(tokens, dtype=np.int64), np.asarray(tokens, dtype=np.uint32)):
        keys = page_keys(ns.namespace_id, form, 16)
        assert len(keys) == 512
        assert (keys[0].hex(), keys[255].hex(), keys[-1].hex()) == (
            "156ee767b97571297dfe6e7d81df5970", "c9bd943a35244c3716594d77ee897b14", "43394c4f890b4210b9bd2156e4f72df4")
        assert hashlib.sha256(b"".join(keys)).hexdigest() == "f63113a635183ffb44b6b9aba0e931b1e2a1971bbcd0be74270590ae5a5a7ad8"
    keys = page_keys(ns.namespace_id, [2**32 - 1, 0, 65536, 7] * 40, 32)
    assert len(keys) == 5 and keys[-1].hex() == "e2df9695c9e9c574e73a02bef890351e"


def test_the_native_chain_is_hashlibs() -> None:
    """csrc/_keys.c against hashlib over random chains: first keys, page sizes and lengths
    around BLAKE2b's 128-byte block (one block, exactly one, one byte over, several)."""
    if page_key_module.chain_keys is None:
        pytest.skip("kvstore._keys was not built (no C compiler): hashlib computes the keys")
    chain = page_key_module.chain_keys
    rng = random.Random(7)
    for _ in range(2000):
        first = os.urandom(rng.choice([0, 1, 16, 111, 112, 113, 127, 128, 129, 300]))
        page_bytes = rng.choice([4, 64, 96, 108, 112, 116, 128, 132, 256, 4096])
        data = os.urandom(page_bytes * rng.randint(0, 4) + rng.randint(0, page_bytes - 1))
        assert chain(first, data, page_bytes, b"kvstore-page-v1") == hashlib_keys(first, data, page_bytes)
        person = os.urandom(rng.randint(0, 16))
        prev, want = first, []
        for start in range(0, len(data) - page_bytes + 1, page_bytes):
            prev = hashlib.blake2b(prev + data[start : start + page_bytes], digest_size=16, person=person).digest()
            want.append(prev)
        assert chain(first, data, page_bytes, person) == want


def test_a_list_of_ids_takes_the_same_checks() -> None:
    """Lists become arrays without numpy (array('I')); what that refuses, or a list of bools, is
    refused as before, with the same message."""
    ids = [0, 1, 2**32 - 1, 65536]
    assert token_array(ids).dtype == np.dtype("<u4") and token_array(ids).tolist() == ids
    assert token_array([np.int64(5), True, 3]).tolist() == [5, 1, 3]  # numpy typed it int64 too
    assert token_array([]).size == 0
    for bad, message in (([-1, 2], r"\[0, 2\*\*32\)"), ([2**32], r"\[0, 2\*\*32\)"), ([1, 0.5], "integers"),
                         ([True, False], "integers"), ([2**70], "integers"), ([[1, 2]], "1-D")):
        with pytest.raises(InvalidRequest, match=message):
            token_array(bad)


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


@pytest.mark.parametrize("page_tokens", [0, -16])
def test_a_page_size_that_is_not_positive_is_refused(page_tokens: int) -> None:
    """Found by this session's reviewer: 0 raised ZeroDivisionError, a negative size ValueError."""
    with pytest.raises(InvalidRequest, match="page_tokens"):
        page_keys(bytes(16), list(range(64)), page_tokens)


@pytest.mark.parametrize("native", [True, False])
def test_a_page_size_beyond_the_tokens_or_not_an_integer_is_answered_alike(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths give a page size longer than the tokens no page (only full pages get keys)
    and refuse one that is no integer. Before: 2**62 raised the native chain's OverflowError
    ("Python int too large to convert to C ssize_t") where hashlib gave [], and 16.0 a
    TypeError about slice indices on both."""
    if native and page_key_module.chain_keys is None:
        pytest.skip("kvstore._keys is not built")
    if not native:
        monkeypatch.setattr(page_key_module, "chain_keys", None)
    for huge in (2**61, 2**62, 10**30):
        assert page_keys(bytes(16), list(range(64)), huge) == []
    for bad in (16.0, "16", None, True):
        with pytest.raises(InvalidRequest, match="page_tokens"):
            page_keys(bytes(16), list(range(64)), bad)  # type: ignore[arg-type]
    assert page_keys(bytes(16), list(range(64)), np.int64(16)) == page_keys(bytes(16), list(range(64)), 16)
