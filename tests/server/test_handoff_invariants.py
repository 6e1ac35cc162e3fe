"""Handoffs under random operations on one server (DESIGN §12.7), checked after every step against a
simple model: puts, completes, waits with known and forged ids, reads, invalidations and ttl
expiry in random order. A wait's pages are exactly the model's bytes of the current generation
(never an older one's); the server's leases are exactly the markers' pins plus nothing; no more
markers than the bound; after expiry nothing is left. Prints the seed on failure."""

from __future__ import annotations

import random

import pytest
import torch
from support.kv import random_kv

from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.errors import LimitExceeded

PROMPTS = 4
PAGES = 3


def _tokens(prompt: int, page_tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + prompt)
    return torch.randint(0, 50_000, (PAGES * page_tokens,), generator=g).tolist()


def _check(server: object) -> None:
    markers = server.handoffs  # type: ignore[attr-defined]
    held = {lease for marker in list(markers._markers.values()) for lease in marker.leases}
    counts = server.core.leases.counts()  # type: ignore[attr-defined]
    assert counts.lease_ids == held, "leases that no marker holds, or markers' leases gone"
    assert counts.num_allocations == 0
    assert len(markers) <= markers.per_tenant
    # every wait's hit is read at once here: nothing handed stays pinned after the read that took it over
    assert not any(marker.handed for marker in list(markers._markers.values())), "handed pages outlived their read"
    for marker in list(markers._markers.values()):
        assert markers.held(marker.namespace_id, list(marker.pinned)) == len(marker.pinned), "a pinned page is not held"


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_handoffs_keep_the_model(server, ns, layout, seed: int) -> None:
    rng = random.Random(seed)
    server.handoffs.per_tenant = 6
    now = [0.0]
    server.handoffs.clock = lambda: now[0]
    generation = 0
    stored: set[int] = set()  # prompts stored in the current generation
    handoffs: dict[str, int] = {}  # id -> generation it was completed in
    prompts = [_tokens(p, layout.page_tokens) for p in range(PROMPTS)]

    def kv_of(prompt: int) -> torch.Tensor:
        return random_kv(layout, PAGES * layout.page_tokens, seed=100 * generation + prompt)

    async with KVStoreClient(server.address, ns) as client:
        for step in range(60):
            op = rng.choice(["put", "put", "complete", "complete", "wait", "wait", "wait", "invalidate", "expire"])
            prompt = rng.randrange(PROMPTS)
            try:
                if op == "put":
                    assert await client.put(prompts[prompt], kv_of(prompt), generation=generation) == len(prompts[prompt])
                    stored.add(prompt)
                elif op == "complete":
                    ident = new_handoff_id()
                    try:
                        n = await client.handoff_complete(ident, prompts[prompt])
                    except LimitExceeded:
                        assert len(server.handoffs) == server.handoffs.per_tenant
                        continue
                    assert n == (len(prompts[prompt]) if prompt in stored else 0)
                    handoffs[ident] = generation
                elif op == "wait":
                    ident = rng.choice([*handoffs, new_handoff_id()])
                    hit = await client.handoff_wait(ident, prompts[prompt], deadline_s=0.05)
                    assert hit.num_tokens == (len(prompts[prompt]) if prompt in stored else 0)
                    if hit.num_tokens:
                        assert hit.generation == generation
                        out = torch.zeros_like(kv_of(prompt))
                        assert await client.get(hit, out) == hit.num_tokens
                        assert torch.equal(out, kv_of(prompt)), "a wait handed bytes other than the current generation's"
                elif op == "invalidate":
                    generation = await client.invalidate()
                    stored.clear()
                    server.handoffs.expire()  # the sweeper's round, without waiting for it
                else:
                    now[0] += 31.0
                    server.handoffs.expire()
                    assert len(server.handoffs) == 0
                _check(server)
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, step {step} ({op}, prompt {prompt}): {exc}") from exc
        now[0] += 31.0
        server.handoffs.expire()
        assert len(server.handoffs) == 0 and server.core.leases.counts().num_leases == 0
