"""Checks every request field before it reaches domain code; errors say what was wrong."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvstore._proto import common_pb2
from kvstore.errors import InvalidRequest
from kvstore.page import LayoutDesc
from kvstore.types import DTYPE_BYTES, MAX_GENERATION, NAMESPACE_ID_BYTES, PAGE_KEY_BYTES

_MAX_DIM = 1 << 16


def namespace_id(value: bytes) -> bytes:
    if len(value) != NAMESPACE_ID_BYTES:
        raise InvalidRequest(f"namespace_id must be {NAMESPACE_ID_BYTES} bytes, got {len(value)}")
    return bytes(value)


def keys(values: Sequence[bytes], max_count: int, allow_empty: bool = False) -> list[bytes]:
    if not values and not allow_empty:
        raise InvalidRequest("keys must not be empty")
    if len(values) > max_count:
        raise InvalidRequest(f"too many keys: {len(values)} (at most {max_count} per request)")
    out = values if type(values) is list else list(values)  # protobuf hands out bytes: no copy per key
    i = _first_bad_length(out, PAGE_KEY_BYTES)
    if i >= 0:
        raise InvalidRequest(f"keys[{i}] must be {PAGE_KEY_BYTES} bytes, got {len(out[i])}")
    return out


def first_bad_length_python(keys: list[bytes], length: int) -> int:
    """kvstore._lookup.first_bad_length without the C build."""
    if set(map(len, keys)) - {length}:
        return next(i for i, key in enumerate(keys) if len(key) != length)
    return -1


try:
    from kvstore._lookup import first_bad_length as _first_bad_length
except ImportError:  # built without a C compiler (setup.py)
    _first_bad_length = first_bad_length_python


def layout(msg: common_pb2.Layout) -> LayoutDesc:
    if msg.dtype not in DTYPE_BYTES:
        raise InvalidRequest(f"layout.dtype {msg.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}")
    if msg.kv_factor not in (1, 2):
        raise InvalidRequest(f"layout.kv_factor must be 1 or 2, got {msg.kv_factor}")
    for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
        value = getattr(msg, name)
        if not 0 < value <= _MAX_DIM:
            raise InvalidRequest(f"layout.{name} must be in [1, {_MAX_DIM}], got {value}")
    return LayoutDesc(msg.num_layers, msg.kv_factor, msg.num_kv_heads, msg.head_dim, msg.dtype, msg.page_tokens)


def layout_msg(desc: LayoutDesc) -> common_pb2.Layout:
    return common_pb2.Layout(
        num_layers=desc.num_layers, kv_factor=desc.kv_factor, num_kv_heads=desc.num_kv_heads,
        head_dim=desc.head_dim, dtype=desc.dtype, page_tokens=desc.page_tokens,
    )


def tier(value: str, allowed: Sequence[str]) -> str:
    if value and value not in allowed:
        raise InvalidRequest(f"tier {value!r} is not one of {', '.join(allowed)}")
    return value


def deadline_s(value: object, name: str) -> float:
    """A deadline: a finite number of seconds above 0 (every call has one; ``inf`` is none)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise InvalidRequest(f"{name} must be a finite number of seconds above 0 (every call has a deadline), got {value!r}")
    return float(value)



def generation(value: int) -> int:
    """A namespace generation a call names (DESIGN §12.4): at most MAX_GENERATION."""
    if not 0 <= value <= MAX_GENERATION:
        raise InvalidRequest(f"generation {value} is outside [0, {MAX_GENERATION}]")
    return value
