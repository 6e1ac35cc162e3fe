"""Token write-ahead log: a generation killed midway (worker and server) resumes from the
log and the stored KV exactly like an uninterrupted greedy generation."""

from __future__ import annotations

import pytest
import torch
from support.hf_model import greedy, namespace_for, tiny_qwen3

from kvstore.client import KVStoreClient
from kvstore.client.adapters.hf import HFKVCache
from kvstore.errors import InvalidRequest


async def test_resume_after_worker_and_server_crash(server_process) -> None:
    torch.set_num_threads(1)
    model, config = tiny_qwen3()
    prompt = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(5))
    uninterrupted = greedy(model, prompt, steps=32)
    server_process.start()
    async with KVStoreClient(server_process.address, namespace_for(config)) as client:
        session = client.session("req-1", sync_every=4, sync_ms=600_000)  # count-driven only: no timing in the test
        await session.start(prompt[0])
        with torch.no_grad():
            out = model(prompt, use_cache=True)
        assert await HFKVCache(client, config).save(prompt, out.past_key_values, durable=True) == 144
        past, logits, shown = out.past_key_values, out.logits, []
        for _ in range(14):  # generate 14 tokens; the user sees only what is durable
            token = int(torch.argmax(logits[0, -1]))
            durable = await session.returned([token])
            shown = uninterrupted[: durable - 150]
            with torch.no_grad():
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits
        assert len(shown) == 12, "sync_every=4: 12 of 14 tokens were durable (and shown)"
        # the worker dies here: 2 tokens were never synced, hence never shown
    server_process.kill()
    server_process.start()
    async with KVStoreClient(server_process.address, namespace_for(config)) as client:
        rec = await client.recover("req-1")
        assert rec is not None and rec.prompt_tokens == 150
        assert rec.returned == uninterrupted[:12] == shown
        assert rec.stored_tokens == 144 and rec.to_prefill == rec.tokens[144:-1]
        n, past = await HFKVCache(client, config).restore(rec.tokens)
        assert n == 144
        resumed = greedy(model, torch.tensor([rec.tokens]), past, steps=32 - 12)
        assert rec.returned + resumed == uninterrupted
        assert await client.recover("never-logged") is None
    server_process.terminate()


async def test_appends_are_idempotent_and_gaps_rejected(server, layout, ns) -> None:
    async with KVStoreClient(server.address, ns) as client:
        session = client.session("s")
        await session.start([1, 2, 3])
        await session.returned([4])
        retry = client.session("s")
        retry.logged = 3  # a writer that did not see the ack of [4] retries it
        await retry.returned([4])
        rec = await client.recover("s")
        assert rec.tokens == [1, 2, 3, 4] and rec.returned == [4]
        bad = client.session("s")
        bad.logged = 10
        with pytest.raises(InvalidRequest, match="expects 10"):
            await bad.returned([5])
        await session.end()
        assert await client.recover("s") is None


async def test_an_append_that_conflicts_with_the_log_is_refused_not_acknowledged(server, layout, ns) -> None:
    """Bug: an append counted as a retry whenever its end fell inside the logged length,
    whatever its tokens: a second writer appending [7, 8, 9] at 0 to a log of [1, 2, 3] got
    3 back (success) and believed its tokens were logged. A retry must repeat the logged
    tokens; anything else is InvalidRequest, and the log is unchanged."""
    async with KVStoreClient(server.address, ns) as client:
        assert await client.append_tokens("s", [1, 2, 3], expected_length=0, sync=True) == 3
        assert await client.append_tokens("s", [4, 5], expected_length=3, sync=True) == 5
        assert await client.append_tokens("s", [1, 2, 3], expected_length=0, sync=True) == 5  # true retries
        assert await client.append_tokens("s", [4, 5], expected_length=3, sync=True) == 5
        assert await client.append_tokens("s", [2, 3, 4], expected_length=1, sync=True) == 5  # spans two appends
        for tokens, at in (([7, 8, 9], 0), ([4, 6], 3), ([3, 9], 2)):
            with pytest.raises(InvalidRequest, match="conflict"):
                await client.append_tokens("s", tokens, expected_length=at, sync=True)
        assert (await client.read_session("s")).tokens == [1, 2, 3, 4, 5]


async def test_an_append_of_out_of_range_token_ids_is_invalid_request(server, layout, ns) -> None:
    """Bug: append_tokens([-5]) raised protobuf's ValueError 'Value out of range' (no
    KVStoreError), where put of the same ids is InvalidRequest; nothing is logged."""
    async with KVStoreClient(server.address, ns) as client:
        for tokens in ([-5], [1 << 32], [1.5]):
            with pytest.raises(InvalidRequest, match="token ids"):
                await client.append_tokens("s", tokens, expected_length=0, sync=True)
        assert await client.read_session("s") is None


async def test_a_flush_the_node_refuses_keeps_its_tokens_for_the_next(server, ns) -> None:
    """An append refused for now (TierUnavailable: the session freezing for a migration, a node
    not caught up) left the log without the tokens of that flush: they were taken out of the
    buffer before the append, so the next flush appended after them and the log had a hole.
    They stay pending until an append takes them."""
    from kvstore.errors import TierUnavailable
    from kvstore.server.session_owners import FREEZING, OWNED, Ownership

    async with KVStoreClient(server.address, ns) as client:
        session = client.session("s", sync_every=2, sync_ms=600_000)
        await session.start([1, 2, 3])
        server.session_owners.put(client.namespace.namespace_id, "s", Ownership(0, FREEZING, "n2"))
        with pytest.raises(TierUnavailable):
            await session.returned([10, 11])
        server.session_owners.put(client.namespace.namespace_id, "s", Ownership(0, OWNED, ""))
        assert await session.returned([12, 13]) == 7
        logged = await client.read_session("s")
        assert logged is not None and logged.tokens == [1, 2, 3, 10, 11, 12, 13]
