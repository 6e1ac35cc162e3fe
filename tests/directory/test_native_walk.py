"""The native prefix walk and key-length check (csrc/_lookup.c) answer exactly as their
Python fallbacks do, on a real Directory: random publishes, removes and namespaces, lookups
from every start, cached and uncached best locations."""

from __future__ import annotations

import random

import pytest

from kvstore import validate
from kvstore.directory import Directory, store
from kvstore.errors import InvalidRequest

try:
    from kvstore import _lookup as native
except ImportError:  # built without a C compiler: only the fallback exists
    native = None
needs_native = pytest.mark.skipif(native is None, reason="built without a C compiler: only the fallback exists")

NS, OTHER = b"n" * 16, b"o" * 16


def _lookup_with(walk: object, d: Directory, ns: bytes, keys: list[bytes], monkeypatch: pytest.MonkeyPatch) -> object:
    with monkeypatch.context() as m:
        m.setattr(store, "_walk", walk)
        return d.lookup(ns, keys)


@needs_native
def test_the_native_walk_answers_as_the_python_one(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(29)
    d = Directory(tmp_path, "me")
    keys = [rng.randbytes(16) for _ in range(600)]
    for step in range(40):
        lo = rng.randrange(len(keys))
        hi = min(len(keys), lo + rng.randrange(1, 200))
        op = rng.random()
        if op < 0.5:
            node, tier = rng.choice([("me", "host"), ("me", "ssd"), ("other", "remote")])
            d.publish(rng.choice([NS, NS, OTHER]), [(k, node, tier, rng.choice([4096, 8192])) for k in keys[lo:hi]])
        elif op < 0.7:
            for k in keys[lo:hi]:
                d.remove(k)
        for ns in (NS, OTHER):
            for start in (0, rng.randrange(len(keys))):
                asked = keys[start:]
                # each walk goes first on every other step: the first meets the entries a change left uncached
                walks = [native.walk, store.walk_python] if step % 2 else [store.walk_python, native.walk]
                first, second = (_lookup_with(walk, d, ns, asked, monkeypatch) for walk in walks)
                assert first == second, (ns, start, step)
    d.close()


@pytest.mark.parametrize("walk", ["native", "python"])
def test_a_walk_continues_a_run_across_an_uncached_entry(tmp_path, walk: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry whose best location is not cached stops the native walk there; the directory
    fills it in and the walk goes on, in the same run."""
    if walk == "native" and native is None:
        pytest.skip("built without a C compiler: only the fallback exists")
    monkeypatch.setattr(store, "_walk", native.walk if walk == "native" else store.walk_python)
    d = Directory(tmp_path, "me")
    keys = [i.to_bytes(16, "little") for i in range(100)]
    d.publish(NS, [(k, "me", "host", 4096) for k in keys])
    assert sum(r.num_pages for r in d.lookup(NS, keys)) == 100  # every entry's best location now cached
    d.publish(NS, [(keys[50], "me", "ssd", 4096)])  # a change: entry 50's cache is reset, its best still host
    runs = d.lookup(NS, keys)
    assert [(r.tier, r.num_pages) for r in runs] == [("host", 100)]
    d.close()


@needs_native
def test_a_walk_refuses_what_is_not_a_directory(tmp_path) -> None:
    with pytest.raises(TypeError):
        native.walk({}, (b"k",), NS, 0, [], store.Entry, store._ENTRY_NS, store._ENTRY_WHERE)  # keys: a list
    with pytest.raises(TypeError):
        native.walk({}, [], NS, 0, [["not", "a", "run"]], store.Entry, store._ENTRY_NS, store._ENTRY_WHERE)
    assert native.walk({}, [b"k"], NS, 5, [], store.Entry, store._ENTRY_NS, store._ENTRY_WHERE) == (5, True)


@needs_native
@pytest.mark.parametrize("keys", [[], [b"k" * 16] * 3, [b"k" * 16, b"k" * 15], [b"k" * 17], [b"k" * 16] * 9 + [b""],
                                  [bytearray(16), b"k" * 16], [b"k" * 16, bytearray(3)]])
def test_the_native_length_check_answers_as_the_python_one(keys: list[bytes]) -> None:
    assert native.first_bad_length(keys, 16) == validate.first_bad_length_python(keys, 16)


def test_a_bad_key_is_named_by_its_index() -> None:
    with pytest.raises(InvalidRequest, match=r"keys\[2\] must be 16 bytes, got 15"):
        validate.keys([b"k" * 16, b"k" * 16, b"k" * 15], 10)
