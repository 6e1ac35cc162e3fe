"""The RPCs to fuzz, from the descriptors, and damage to client streams (fuzz.py).

A client stream (WritePages: PageChunk messages) is damaged as a whole, as a peer that
misbehaves would: chunks out of order, duplicated or dropped, the stream cut mid-page or
cancelled mid-stream, one chunk's fields mutated or its encoding damaged, random chunks.
"""

from __future__ import annotations

import importlib
import pkgutil
import random
from collections.abc import Iterator
from typing import Any

from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

import kvstore._proto
from kvstore.bench.fuzz import fuzz_mutate


def every_method() -> Iterator[tuple[ServiceDescriptor, MethodDescriptor]]:
    """Every RPC of every service in kvstore/_proto."""
    for info in sorted(pkgutil.iter_modules(kvstore._proto.__path__), key=lambda i: i.name):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"kvstore._proto.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                yield from ((service, method) for method in service.methods)


def _swap(chunks: list[bytes], rng: random.Random) -> list[bytes]:
    if len(chunks) > 1:
        i, j = rng.sample(range(len(chunks)), 2)
        chunks[i], chunks[j] = chunks[j], chunks[i]
    return chunks


def _fields(chunks: list[bytes], request_type: Any, values: fuzz_mutate.Values, rng: random.Random) -> tuple[list[bytes], str]:
    i = rng.randrange(len(chunks))
    message = request_type.FromString(chunks[i])
    done = fuzz_mutate.mutate(message, values, rng)
    chunks[i] = message.SerializeToString()
    return chunks, f"chunk {i} fields: {', '.join(done)}"


def mutate_stream(chunks: list[bytes], request_type: Any, values: fuzz_mutate.Values,
                  rng: random.Random) -> tuple[list[bytes], str, int | None]:
    """(messages to send, what was done, cancel after this many sent or None)."""
    chunks = list(chunks)
    roll = rng.random()
    if roll < 0.2 or not chunks:
        return chunks, "valid stream", None
    if roll < 0.3:
        return chunks, "cancelled mid-stream", rng.randint(0, len(chunks))
    if roll < 0.4:
        return _swap(chunks, rng), "stream: out of order", None
    if roll < 0.47:
        i = rng.randrange(len(chunks))
        return chunks[: i + 1] + chunks[i:], "stream: chunk duplicated", None
    if roll < 0.54:
        del chunks[rng.randrange(len(chunks))]
        return chunks, "stream: chunk dropped", None
    if roll < 0.64:
        return chunks[: rng.randrange(len(chunks))], "stream: cut mid-page", None
    if roll < 0.8:
        done, what = _fields(chunks, request_type, values, rng)
        return done, f"stream: {what}", None
    if roll < 0.9:
        i = rng.randrange(len(chunks))
        chunks[i], op = fuzz_mutate.mutate_encoding(chunks[i], rng)
        return chunks, f"stream: chunk {i} encoding: {op}", None
    if roll < 0.96:
        chunks.insert(rng.randint(0, len(chunks)), fuzz_mutate.random_bytes(rng))
        return chunks, "stream: random chunk", None
    return [], "stream: empty", None
