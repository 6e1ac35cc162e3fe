"""Test-only hooks around the real connector (loaded by vLLM from this module):
* a pause between the scheduler's lookup and the workers' load, to kill the store there;
* wrong KV written over one loaded layer, for the negative control (of a hybrid engine:
  the layer in page order, its tokens reversed before they are written into the blocks;
  or the states of its state-space layers zeroed).
The runner (vllm_engine.py) switches them through the module globals below."""

from __future__ import annotations

from typing import Any

from kvstore.client.adapters.vllm import KVStoreConnector
from kvstore.client.adapters.vllm.hybrid_worker import HybridWorkerSide

PAUSE: dict[str, str] = {}  # {"paused": fifo to announce on, "resume": fifo to wait on}; one use
CORRUPT_LAYER: list[int] = []  # the layer whose loaded pages are overwritten with wrong KV
CORRUPT_STATE: list[bool] = []  # [True]: a hybrid load writes zeros for the states it loaded


class HookedConnector(KVStoreConnector):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if PAUSE and result[0]:
            paused, resume = PAUSE.pop("paused"), PAUSE.pop("resume")
            with open(paused, "w") as f:
                f.write(f"{result[0]}\n")
            with open(resume) as f:
                f.readline()
        return result

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self._worker()
        if not ((CORRUPT_LAYER or CORRUPT_STATE) and isinstance(worker, HybridWorkerSide)):
            super().start_load_kv(forward_context, **kwargs)
            return
        grouped, states = worker._blocks(), worker._states
        right, right_states = grouped.scatter, states.scatter if states is not None else None

        def wrong(pages: Any, block_ids: Any, first_page: int) -> int:
            if CORRUPT_LAYER:
                pages[CORRUPT_LAYER[0]] = pages[CORRUPT_LAYER[0]].flip(1)  # tokens in reverse order
            return right(pages, block_ids, first_page)

        def wrong_states(staging: Any, blocks: Any) -> None:
            assert right_states is not None
            right_states(staging.zero_() if CORRUPT_STATE else staging, blocks)

        grouped.scatter = wrong  # type: ignore[method-assign]
        if states is not None:
            states.scatter = wrong_states  # type: ignore[method-assign]
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            del grouped.scatter
            if states is not None:
                del states.scatter

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        worker = self._worker()
        if CORRUPT_LAYER and not isinstance(worker, HybridWorkerSide) and worker._layer_index.get(layer_name) == CORRUPT_LAYER[0]:
            layer = CORRUPT_LAYER[0]
            for active in worker._loads:
                for page in range(active.spec.num_pages):
                    wrong = active.kv.read_layer(page, layer).flip(1)  # tokens in reverse order
                    active.kv.write_layer(page, layer, wrong)


