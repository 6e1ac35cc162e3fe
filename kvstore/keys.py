"""Chained page keys: ``key[i] = H(key[i-1] || tokens of page i)``, ``key[-1] = namespace_id``.

H is BLAKE2b truncated to 16 bytes (collision-resistant, so a tenant cannot craft a
collision). Tokens are hashed as little-endian uint32, so the keys are the same on every
process and machine. Only full pages get keys.

More: kvstore/README.md (### keys.py).
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.types import PAGE_KEY_BYTES

try:
    from kvstore._keys import chain_keys
except ImportError:  # built without the extension: hashlib below
    chain_keys = None

_PERSON = b"kvstore-page-v1"
_LIST_ARRAY = array.array("I").itemsize == 4  # "I" is a uint32 here: lists take array('I')


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a uint32 array; raises InvalidRequest for ids outside [0, 2**32)."""
    if _LIST_ARRAY and type(tokens) is list and not (tokens and type(tokens[0]) is bool):
        try:  # every item an int in [0, 2**32) (a list of bools is refused below, as numpy types it bool)
            return np.frombuffer(array.array("I", tokens), dtype=np.uint32).astype("<u4", copy=False)
        except (TypeError, OverflowError):
            pass  # a float, a negative or too large id: the checks below say which
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidRequest(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.uint32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= 1 << 32:
        raise InvalidRequest("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def page_keys(namespace_id: bytes, tokens: Sequence[int] | np.ndarray, page_tokens: int) -> list[bytes]:
    """Keys of the full pages of ``tokens``; a trailing partial page gets none."""
    if type(page_tokens) is bool or not hasattr(type(page_tokens), "__index__") or page_tokens <= 0:
        raise InvalidRequest(f"page_tokens must be a positive integer, got {page_tokens!r}")
    arr = token_array(tokens)
    num_pages = arr.size // page_tokens
    if num_pages == 0:  # also a page size past the native chain's ssize_t (hashlib's loop took it)
        return []
    data = np.ascontiguousarray(arr[: num_pages * page_tokens])
    if chain_keys is not None:
        return chain_keys(namespace_id, data, 4 * page_tokens, _PERSON)  # type: ignore[no-any-return]
    return hashlib_keys(namespace_id, data.tobytes(), 4 * page_tokens)


def hashlib_keys(namespace_id: bytes, data: bytes, page_bytes: int) -> list[bytes]:
    """``page_keys`` of ``data`` (the pages' little-endian uint32 tokens) with hashlib: the
    definition the native chain_keys must match, and its stand-in where it was not built."""
    keys: list[bytes] = []
    prev = namespace_id
    base = hashlib.blake2b(digest_size=PAGE_KEY_BYTES, person=_PERSON)
    view = memoryview(data)
    for start in range(0, len(data) - page_bytes + 1, page_bytes):
        h = base.copy()
        h.update(prev)
        h.update(view[start : start + page_bytes])
        prev = h.digest()
        keys.append(prev)
    return keys
