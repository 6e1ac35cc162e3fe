"""Chained page keys: ``key[i] = H(key[i-1] || tokens of page i)``, ``key[-1] = namespace_id``.

H is BLAKE2b truncated to 16 bytes (collision-resistant, so a tenant cannot craft a
collision). Tokens are hashed as little-endian uint32, so the keys are the same on every
process and machine. Only full pages get keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.types import PAGE_KEY_BYTES

_PERSON = b"kvstore-page-v1"


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a uint32 array; raises InvalidRequest for ids outside [0, 2**32)."""
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
    arr = token_array(tokens)
    keys: list[bytes] = []
    prev = namespace_id
    for start in range(0, arr.size - page_tokens + 1, page_tokens):
        h = hashlib.blake2b(prev, digest_size=PAGE_KEY_BYTES, person=_PERSON)
        h.update(arr[start : start + page_tokens].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
