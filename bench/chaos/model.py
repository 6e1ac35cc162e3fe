"""What a chaos history may observe, as a function of what it did.

Page bytes are a pure function of (tenant, namespace, generation, page key): every put of a
page in a generation writes the same bytes, so a read is checked page by page without
knowing which put it saw, and a page of another key, tenant or generation is told apart.
A namespace's generation only rises, by one per invalidation (``raise_above`` in etcd), so a
read that starts at ``t0`` and ends at ``t1`` may see generations in ``[A(t0), S(t1)]``: A
the highest an invalidation acknowledged before ``t0``, S how many invalidations started
before ``t1`` (acknowledged or not: a failed one may still have raised it)."""

from __future__ import annotations

import functools
import hashlib

import torch

from kvstore import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)
PAGE_SHAPE = (LAYOUT.num_layers, LAYOUT.kv_factor, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)


@functools.lru_cache(maxsize=4096)
def page(tenant: str, namespace: str, generation: int, key: bytes) -> torch.Tensor:
    """The one value page ``key`` has in ``generation`` of ``tenant``'s ``namespace``."""
    seed = hashlib.blake2b(f"{tenant}|{namespace}|{generation}|".encode() + key, digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(seed, "little") & ((1 << 63) - 1))
    return torch.randn(PAGE_SHAPE, generator=g).to(LAYOUT.torch_dtype())


def digest(tensor: torch.Tensor) -> str:
    """A page's bytes, short enough to record every page a history read."""
    return hashlib.blake2b(tensor.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=12).hexdigest()


@functools.lru_cache(maxsize=16384)
def page_digest(tenant: str, namespace: str, generation: int, key: bytes) -> str:
    return digest(page(tenant, namespace, generation, key))


def prefix_kv(tenant: str, namespace: str, generation: int, keys: list[bytes]) -> torch.Tensor:
    """The KV of a prefix of whole pages, as a put sends it: pages along the token dimension."""
    return torch.cat([page(tenant, namespace, generation, k) for k in keys], dim=2)


def page_digests(kv: torch.Tensor, num_pages: int) -> list[str]:
    """The digest of each of the first ``num_pages`` pages of ``kv`` (a get's output)."""
    t = LAYOUT.page_tokens
    return [digest(kv[:, :, i * t:(i + 1) * t]) for i in range(num_pages)]


class Generations:
    """One namespace's invalidations in a history: (start, end, generation or None)."""

    def __init__(self) -> None:
        self._calls: list[tuple[float, float, int | None]] = []

    def add(self, start: float, end: float, generation: int | None) -> None:
        self._calls.append((start, end, generation))

    def lowest(self, t0: float) -> int:
        """A(t0): no read starting at ``t0`` may see a generation below it."""
        return max((g for s, e, g in self._calls if g is not None and e < t0), default=0)

    def highest(self, t1: float) -> int:
        """S(t1): no read ending at ``t1`` may see a generation above it."""
        return sum(1 for s, _, _ in self._calls if s < t1)

    def invalidated_after(self, t: float) -> bool:
        """Whether an invalidation started at or after ``t`` (its outcome then unknown to a call at ``t``)."""
        return any(s >= t for s, _, _ in self._calls)

    def unsettled_at(self, t: float) -> bool:
        """Whether an invalidation started before ``t`` had not been acknowledged by ``t``
        (still running, or failed: whether it raised the generation is unknown)."""
        return any(s < t and (g is None or e >= t) for s, e, g in self._calls)
