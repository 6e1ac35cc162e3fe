"""The scheduler side of disaggregated prefill (client/adapters/vllm/pd.py) without an
engine: what it offers vLLM, what it plans for the workers, what a prefill returns. vLLM's
requests and blocks are stand-ins with the attributes the connector reads; the store is a
connection that cannot connect (these decisions take no store call). The exchange on real
engines is test_vllm_pd.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstore import KVLayout, Namespace
from kvstore.client.adapters.connection import StoreConnection
from kvstore.client.adapters.vllm.metadata import KVStoreConnectorMetadata
from kvstore.client.adapters.vllm.pd import HandoffScheduler
from kvstore.client.adapters.vllm.scheduler import RequestState, SchedulerSide

BLOCK = 32
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_tokens=BLOCK)
HANDED = {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": "ab" * 16, "kvstore_num_tokens": 128}


@pytest.fixture
def handoffs() -> Iterator[HandoffScheduler]:
    store = StoreConnection("127.0.0.1:1", Namespace(model="pd", revision="r", layout=LAYOUT), connect_timeout_s=0.1)
    yield HandoffScheduler(SchedulerSide(store, BLOCK, lookup_timeout_s=0.1), deadline_s=10.0, ttl_s=30.0)
    store.close()


def request(req_id: str, tokens: list[int], params: dict[str, Any] | None, status: str = "RUNNING",
            computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=list(tokens), kv_transfer_params=params,
                           status=SimpleNamespace(name=status), num_computed_tokens=computed)


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def planned(handoffs: HandoffScheduler) -> KVStoreConnectorMetadata:
    return handoffs.add_to(KVStoreConnectorMetadata())


def test_a_decode_is_offered_the_handed_off_pages_short_of_the_last_token_once(handoffs: HandoffScheduler) -> None:
    req = request("d", list(range(1, 129)), dict(HANDED))  # 4 whole pages handed off; the last token is computed
    assert handoffs.matched(req, 0) == (3 * BLOCK, True)
    assert handoffs.matched(req, 0) == (3 * BLOCK, True), "vLLM may ask again before it allocates"
    assert handoffs.after_alloc(req, blocks([7, 8, 9, 10]), 3 * BLOCK)
    (load,) = planned(handoffs).handoff_loads
    assert (load.first_page, load.num_pages, load.block_ids, load.deadline_s) == (0, 3, [7, 8, 9, 10], 10.0)
    assert load.tokens == list(range(1, 97)) and load.handoff_id == "ab" * 16
    assert req.kv_transfer_params["do_remote_prefill"] is False
    assert handoffs.matched(req, 0) == (0, False), "a load that failed is recomputed, not offered again"
    assert handoffs.scheduler.requests["d"].stored_pages == 3, "its saves start past the handed-off pages"


def test_a_decode_loads_past_vllms_own_cache_within_the_requests_deadline(handoffs: HandoffScheduler) -> None:
    req = request("d", list(range(1, 140)), dict(HANDED, kvstore_deadline_s=0.5))
    assert handoffs.matched(req, BLOCK) == (3 * BLOCK, True)
    handoffs.after_alloc(req, blocks([1, 2, 3, 4, 5]), 3 * BLOCK)
    (load,) = planned(handoffs).handoff_loads
    assert (load.first_page, load.num_pages, load.deadline_s) == (1, 3, 0.5)


def test_a_request_without_a_handoff_is_left_to_the_single_group_side(handoffs: HandoffScheduler) -> None:
    assert handoffs.matched(request("plain", list(range(1, 100)), None), 0) is None
    assert not handoffs.after_alloc(request("plain", list(range(1, 100)), None), blocks([1]), 0)


def test_a_prefill_opens_at_alloc_and_returns_the_handoff_when_it_ends(handoffs: HandoffScheduler) -> None:
    prompt = list(range(1, 150))
    req = request("p", prompt, {"do_remote_decode": True, "kvstore_decode_node": "nd"})
    assert handoffs.matched(req, 0) is None, "a prefill is looked up, loaded and saved as any request"
    assert not handoffs.after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    (opened,) = planned(handoffs).handoff_opens
    assert opened.to_node == "nd" and opened.tokens == prompt[:128] and opened.ttl_s == 30.0
    req.status, req.num_computed_tokens = SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), len(prompt)
    held, params = handoffs.finished(req, saving=False)
    assert held and handoffs.holds_blocks, "its blocks stay until the handoff is complete"
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_handoff_id": opened.handoff_id,
                      "kvstore_prefill_node": "", "kvstore_decode_node": "nd", "kvstore_num_tokens": 128}
    (done,) = planned(handoffs).handoff_completes
    assert done.tokens == prompt[:128] and done.handoff_id == opened.handoff_id
    handoffs.sent({"p"})
    assert not handoffs.holds_blocks


def test_a_prefill_hands_its_requests_generation_to_the_decode(handoffs: HandoffScheduler) -> None:
    """The generation the prefill's lookup saw goes with the handoff (``kvstore_generation``): the
    decode's saves name it (DESIGN §3)."""
    prompt = list(range(1, 150))
    req = request("p", prompt, {"do_remote_decode": True, "kvstore_decode_node": "nd"})
    assert handoffs.matched(req, 0) is None
    handoffs.scheduler.adopt(RequestState(req, prompt, 0, 0, generation=3))  # what its lookup saw
    handoffs.after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    req.status, req.num_computed_tokens = SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), len(prompt)
    _, params = handoffs.finished(req, saving=False)
    assert params is not None and params["kvstore_generation"] == 3


def test_an_aborted_prefill_returns_nothing_and_its_handoff_expires(handoffs: HandoffScheduler) -> None:
    req = request("p", list(range(1, 150)), {"do_remote_decode": True})
    handoffs.matched(req, 0)
    handoffs.after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    (opened,) = planned(handoffs).handoff_opens
    assert opened.to_node is None, "no decode node named: through the pool"
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert handoffs.finished(req, saving=True) == (True, None)
    assert not planned(handoffs).handoff_completes and not handoffs.holds_blocks
