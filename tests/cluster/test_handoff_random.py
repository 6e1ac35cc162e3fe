"""Handoffs across three real nodes under random operations (DESIGN §12.7), checked against a model
after each step: handoffs from any node to any other (pushed as stored, pushed at complete, through
the pool, or saved layer by layer with layers pushed ahead: some saves given up midway and saved
again with other bytes, some cut by an invalidation between their layers and their commit), waits
with the handoff's id and with forged ids, handoffs abandoned (completed with no page) after their
pushes began, invalidations. Every wait answers the whole prompt
exactly when the model holds it in the current generation, its bytes are the current generation's,
and once every hit was read no node holds a pin. Prints the seed."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
import torch
from support.cluster_nodes import cluster_nodes_fixture  # noqa: F401  # the fixture
from support.etcd_proc import etcd_fixture  # noqa: F401  # the fixture
from support.kv import random_kv
from test_cluster_nodes import LAYOUT, NS, tokens_of
from test_handoff import num_leases

from kvstore.client import KVStoreClient, new_handoff_id
from kvstore.errors import KVStoreError

NAMES = ["a", "b", "c"]


@pytest.mark.parametrize("seed", [7, 11, 13, 29])
async def test_random_handoffs_across_nodes_keep_the_model(cluster_nodes, seed: int) -> None:
    rng = random.Random(seed)
    nodes = dict(zip(NAMES, cluster_nodes(NAMES, "tcp")))
    generation = 0
    stored: set[int] = set()  # prompts stored somewhere in the current generation
    prompts = [tokens_of(300 + p, 3) for p in range(5)]

    def kv_of(prompt: int) -> torch.Tensor:
        return random_kv(LAYOUT, len(prompts[prompt]), seed=1000 * generation + prompt)

    clients = {name: KVStoreClient(node.address, NS) for name, node in nodes.items()}
    for client in clients.values():
        client.push_layers_min_bytes = 0  # the prompts are a few small pages: layered handoffs send them ahead all the same
        await client.connect()
    try:
        for step in range(30):
            op = rng.choice(["handoff", "handoff", "handoff", "forged", "abandoned", "invalidate"])
            prompt = rng.randrange(len(prompts))
            prefill, decode = rng.sample(NAMES, 2)
            mode = rng.choice(["streamed", "at-complete", "pool", "layered"])
            try:
                if op == "handoff" and mode == "layered":
                    generation = await _layered(clients[prefill], clients[decode], decode, prompts[prompt], kv_of, prompt,
                                                generation, stored, rng)
                elif op == "handoff":
                    ident, to = new_handoff_id(), None if mode == "pool" else decode
                    await clients[prefill].handoff_open(ident, to, tokens=prompts[prompt] if mode == "streamed" else None)
                    assert await clients[prefill].put(prompts[prompt], kv_of(prompt), generation=generation) == len(prompts[prompt])
                    stored.add(prompt)
                    assert await clients[prefill].handoff_complete(ident, prompts[prompt]) == len(prompts[prompt])
                    await _read(clients[decode], ident, prompts[prompt], kv_of(prompt), generation, expect=True)
                elif op == "abandoned":  # pushed as stored, then nothing handed off: the decode node lets go at once
                    ident = new_handoff_id()
                    await clients[prefill].handoff_open(ident, decode, tokens=prompts[prompt])
                    assert await clients[prefill].put(prompts[prompt], kv_of(prompt), generation=generation) == len(prompts[prompt])
                    stored.add(prompt)
                    await asyncio.sleep(rng.random() * 0.05)  # some pushes landed, some are on their way
                    assert await clients[prefill].handoff_complete(ident, [], decode) == 0
                    if rng.random() < 0.5:  # a wait after it is one on an unknown id: the pool's pages
                        await _read(clients[decode], ident, prompts[prompt], kv_of(prompt), generation, expect=True)
                elif op == "forged":  # an id nobody made: the pool's pages of the caller's own namespace, or nothing
                    await _read(clients[decode], new_handoff_id(), prompts[prompt], kv_of(prompt), generation,
                                expect=prompt in stored)
                else:
                    generation = await clients[prefill].invalidate()
                    stored.clear()
                for name, client in clients.items():
                    assert await num_leases(client) == 0, f"node {name} holds pins after every hit was read"
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, step {step} ({op} {mode} prompt {prompt} {prefill}->{decode}): {exc}") from exc
    finally:
        for client in clients.values():
            await client.close()


async def _layered(prefill: KVStoreClient, decode: KVStoreClient, decode_node: str, tokens: list[int],
                   kv_of: Callable[[int], torch.Tensor], prompt: int, generation: int, stored: set[int],
                   rng: random.Random) -> int:
    """A direct handoff of a layer-wise save whose first layers go ahead. Perhaps a first save with
    other bytes says some layers and is given up (the engine preempted), then the real one; perhaps
    the namespace is invalidated between its layers and its commit (its pages then belong to no
    generation: the wait answers nothing). Returns the generation after it."""
    ident = new_handoff_id()
    await prefill.handoff_open(ident, decode_node, tokens=tokens)
    if rng.random() < 0.4:  # given up midway, with bytes the retry will not store
        first = prefill.save(tokens, random_kv(LAYOUT, len(tokens), seed=rng.randrange(1 << 30)))
        for layer in range(rng.randrange(1, LAYOUT.num_layers)):
            first.layer_done(layer)
        await asyncio.sleep(rng.random() * 0.05)
        first.abandon("preempted")
        first.join(5)
    invalidated = rng.random() < 0.25
    save = prefill.save(tokens, kv_of(prompt))
    for layer in range(rng.randrange(1, LAYOUT.num_layers)):
        save.layer_done(layer)
    await asyncio.sleep(rng.random() * 0.05)
    if invalidated:
        generation = await prefill.invalidate()
        stored.clear()
    try:
        saved = await save.finished()
    except KVStoreError:
        saved = 0
    assert saved == (0 if invalidated else len(tokens)), saved
    if saved:
        stored.add(prompt)
    handed = await prefill.handoff_complete(ident, tokens)  # as the connector does: none stored, none handed off
    assert handed == saved
    await _read(decode, ident, tokens, kv_of(prompt), generation, expect=bool(saved))
    return generation


async def _read(client: KVStoreClient, ident: str, tokens: list[int], kv: torch.Tensor, generation: int, expect: bool) -> None:
    hit = await client.handoff_wait(ident, tokens, deadline_s=1.0)
    assert hit.num_tokens == (len(tokens) if expect else 0), hit.num_tokens
    if hit.num_tokens:
        assert hit.generation == generation
        out = torch.zeros_like(kv)
        assert await client.get(hit, out) == len(tokens)
        assert torch.equal(out, kv), "a handoff delivered bytes other than the current generation's"
