"""Structure-aware mutation of protobuf requests, driven by their descriptors.

Nothing here knows a particular RPC: fields are filled and mutated by type, and the bytes
and strings that carry meaning (namespace ids, page keys, handles, session ids, tiers...)
come from a ``Values`` source that hands out real ones seen during the run, another
tenant's, or near misses (a byte short, a byte long, random). So a field added to the
proto, or a new RPC, is mutated without code here.

More: bench/fuzz/README.md (### fuzz_mutate.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any, Protocol

from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message

from kvstore.page_wire.grpc_chunks import encode_varint

_U32 = (0, 1, 2, 15, 16, 17, 4096, 2**31 - 1, 2**31, 2**32 - 1)
_I32 = (0, 1, -1, 2**31 - 1, -(2**31))
_U64 = (0, 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
_I64 = (0, 1, -1, 2**63 - 1, -(2**63))
_BOUNDS: dict[int, tuple[int, ...]] = {
    F.TYPE_UINT32: _U32, F.TYPE_FIXED32: _U32, F.TYPE_INT32: _I32, F.TYPE_SINT32: _I32, F.TYPE_SFIXED32: _I32,
    F.TYPE_UINT64: _U64, F.TYPE_FIXED64: _U64, F.TYPE_INT64: _I64, F.TYPE_SINT64: _I64, F.TYPE_SFIXED64: _I64,
}
_FLOATS = (0.0, -0.0, -1.0, 1e-300, 1e308, math.inf, -math.inf, math.nan)
_STRINGS = ("", "x", "é\u2603\U0001f600", "a\x00b", "../../etc/passwd", "%s%n", "x" * 300, "y" * 70_000)
_SIZES = (0, 1, 15, 16, 17, 32, 255, 4096)
HUGE_BYTES = 8 << 20  # huge repeated fields stay below this (the server's message limit is 256 MiB)


class Values(Protocol):
    """Meaningful field values for the field named ``name`` (real, foreign or near-miss);
    None: nothing special, a typed random value is used."""

    def bytes_for(self, name: str, rng: random.Random) -> bytes | None: ...

    def string_for(self, name: str, rng: random.Random) -> str | None: ...


def random_bytes(rng: random.Random, size: int | None = None) -> bytes:
    if size is None:
        size = rng.choice((0, 1, 2, 5, 16, 100, 1000, 65536))
    return rng.randbytes(size)


def scalar(field: Any, values: Values, rng: random.Random) -> Any:
    """A value for one (non-message) element of ``field``."""
    kind = field.type
    if kind == F.TYPE_BYTES:
        found = values.bytes_for(field.name, rng) if rng.random() < 0.8 else None
        return found if found is not None else random_bytes(rng, rng.choice(_SIZES))
    if kind == F.TYPE_STRING:
        found = values.string_for(field.name, rng) if rng.random() < 0.8 else None
        return found if found is not None else rng.choice(_STRINGS)
    if kind == F.TYPE_BOOL:
        return rng.random() < 0.5
    if kind in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return rng.choice(_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6)
    if kind == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return rng.choice(known) if rng.random() < 0.7 else rng.choice((-1, 99, 2**31 - 1))
    bounds = _BOUNDS[kind]
    if rng.random() < 0.5:
        return rng.choice(bounds)
    return rng.randint(max(min(bounds), -1000), min(max(bounds), 100_000))


def _is_map(field: Any) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _put_element(msg: Message, field: Any, values: Values, rng: random.Random, depth: int) -> None:
    container = getattr(msg, field.name)
    if _is_map(field):
        key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        key = scalar(key_f, values, rng)
        if value_f.type == F.TYPE_MESSAGE:
            fill(container[key], values, rng, depth + 1)
        else:
            container[key] = scalar(value_f, values, rng)
    elif field.type == F.TYPE_MESSAGE:
        fill(container.add(), values, rng, depth + 1)
    else:
        container.append(scalar(field, values, rng))


def set_field(msg: Message, field: Any, values: Values, rng: random.Random, depth: int = 0) -> None:
    """Gives ``field`` of ``msg`` a fresh random value (a repeated field: 0 to 4 elements)."""
    msg.ClearField(field.name)
    if field.is_repeated:
        for _ in range(rng.choice((0, 1, 1, 2, 4))):
            _put_element(msg, field, values, rng, depth)
    elif field.type == F.TYPE_MESSAGE:
        if depth < 3:
            fill(getattr(msg, field.name), values, rng, depth + 1)
    else:
        setattr(msg, field.name, scalar(field, values, rng))


def fill(msg: Message, values: Values, rng: random.Random, depth: int = 0) -> Message:
    """Sets each field of ``msg`` with probability 0.7 to a random typed value."""
    for field in msg.DESCRIPTOR.fields:
        if rng.random() < 0.7:
            set_field(msg, field, values, rng, depth)
    if not msg.ListFields() and depth == 0 and msg.DESCRIPTOR.fields:
        set_field(msg, rng.choice(msg.DESCRIPTOR.fields), values, rng, depth)
    return msg


def _fields_in(msg: Message, depth: int = 0) -> list[tuple[Message, Any]]:
    """Every (message, field) pair reachable from ``msg``: its own fields, and those of the
    sub-messages it holds (repeated ones included)."""
    found = [(msg, f) for f in msg.DESCRIPTOR.fields]
    if depth >= 3:
        return found
    for field, value in msg.ListFields():
        if field.type != F.TYPE_MESSAGE or _is_map(field):
            continue
        for sub in (value if field.is_repeated else [value]):
            found += _fields_in(sub, depth + 1)
    return found


def _huge(msg: Message, field: Any, values: Values, rng: random.Random) -> None:
    """Fills a repeated field with as many copies of one value as fit in HUGE_BYTES."""
    container = getattr(msg, field.name)
    if _is_map(field):
        return
    if field.type == F.TYPE_MESSAGE:
        first = fill(container.add(), values, rng, 1)
        count = min(rng.choice((65_536, 65_537, 70_000)), HUGE_BYTES // (first.ByteSize() + 3))
        for _ in range(count - 1):
            container.add().CopyFrom(first)
        return
    sample = scalar(field, values, rng)
    if isinstance(sample, (bytes, str)):
        each = len(sample) + 3
    else:
        each = len(encode_varint(sample)) if isinstance(sample, int) and sample >= 0 else 10
    count = min(rng.choice((65_536, 65_537, 100_000, (1 << 20) + 1)), HUGE_BYTES // each)
    container.extend([sample] * count)


def _near_miss(value: Any, rng: random.Random) -> Any:
    """A bytes or string value a little wrong: a byte short or long, one bit flipped."""
    if isinstance(value, bytes) and value:
        op = rng.randrange(3)
        if op == 0:
            return value[:-1]
        if op == 1:
            return value + bytes([rng.randrange(256)])
        i = rng.randrange(len(value))
        return value[:i] + bytes([value[i] ^ (1 << rng.randrange(8))]) + value[i + 1 :]
    if isinstance(value, str):
        return value[:-1] if value and rng.random() < 0.5 else value + "\x00"
    return value


def mutate(msg: Message, values: Values, rng: random.Random) -> list[str]:
    """Changes one to three fields of ``msg`` in place; returns what was done (for reports)."""
    done: list[str] = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        pairs = _fields_in(msg)
        if not pairs:
            break
        owner, field = rng.choice(pairs)
        name = f"{owner.DESCRIPTOR.name}.{field.name}"
        roll = rng.random()
        if roll < 0.12:
            owner.ClearField(field.name)
            done.append(f"clear {name}")
        elif field.is_repeated and roll < 0.16:
            _huge(owner, field, values, rng)
            done.append(f"huge {name}")
        elif field.is_repeated and not _is_map(field) and roll < 0.3 and len(getattr(owner, field.name)):
            items = list(getattr(owner, field.name))
            rng.shuffle(items)
            items += items[: rng.randint(0, len(items))]  # out of order, with duplicates
            owner.ClearField(field.name)
            if field.type == F.TYPE_MESSAGE:
                for item in items:
                    getattr(owner, field.name).add().CopyFrom(item)
            else:
                getattr(owner, field.name).extend(items)
            done.append(f"reorder+duplicate {name}")
        elif not field.is_repeated and field.type in (F.TYPE_BYTES, F.TYPE_STRING) and roll < 0.55:
            setattr(owner, field.name, _near_miss(getattr(owner, field.name), rng))
            done.append(f"near-miss {name}")
        elif field.is_repeated and field.type == F.TYPE_BYTES and roll < 0.55 and len(getattr(owner, field.name)):
            container = getattr(owner, field.name)
            i = rng.randrange(len(container))
            container[i] = _near_miss(container[i], rng)
            done.append(f"near-miss {name}[{i}]")
        else:
            set_field(owner, field, values, rng)
            done.append(f"set {name}")
    return done


def _tag(number: int, wire_type: int) -> bytes:
    return encode_varint((number << 3) | wire_type)


def _insert(raw: bytes, at: int, extra: bytes) -> bytes:
    return raw[:at] + extra + raw[at:]


_ENCODING_OPS: list[tuple[str, Callable[[bytes, random.Random], bytes]]] = [
    ("truncate", lambda raw, rng: raw[: rng.randrange(len(raw))] if raw else b"\x0a"),
    ("bit-flip", lambda raw, rng: bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 4 / max(1, len(raw)) else b for b in raw)),
    ("extend", lambda raw, rng: raw + random_bytes(rng, rng.choice((1, 7, 64, 1000)))),
    ("insert", lambda raw, rng: _insert(raw, rng.randint(0, len(raw)), random_bytes(rng, rng.choice((1, 3, 16))))),
    ("doubled", lambda raw, rng: raw + raw),  # every field twice: repeated ones doubled, scalars last-wins
    ("unknown-field", lambda raw, rng: raw + _tag(rng.choice((15, 1000, 2**29 - 1)), 2) + encode_varint(3) + b"abc"),
    ("wrong-wire-type", lambda raw, rng: _tag(rng.randint(1, 9), rng.choice((0, 1, 5))) + b"\x01\x02\x03\x04\x05\x06\x07\x08" + raw),
    ("overlong-varint", lambda raw, rng: raw + _tag(rng.randint(1, 9), 0) + b"\xff" * 11),
    ("length-past-end", lambda raw, rng: raw + _tag(rng.randint(1, 9), 2) + encode_varint(rng.choice((100, 2**31, 2**62)))),
    ("nested-groups", lambda raw, rng: raw + _tag(rng.randint(1, 9), 3) * rng.choice((10, 200, 5000))),
    ("zero-tag", lambda raw, rng: b"\x00" + raw),
]


def mutate_encoding(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """``raw`` damaged at the encoding level; returns the bytes and the operation's name."""
    name, op = rng.choice(_ENCODING_OPS)
    return op(raw, rng), name
