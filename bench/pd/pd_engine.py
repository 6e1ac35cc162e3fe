"""One vLLM engine of ``kvstore-bench pd`` in its own process, driven by JSON lines.

Usage: ``python -m kvstore.bench.pd.pd_engine MODEL_DIR CONFIG_JSON``, or with no arguments the first
line on stdin ``{"model": MODEL_DIR, "config": CONFIG}``, read once vLLM is imported (the bench starts
the engines first, and makes the model and starts the nodes while they import). The protocol goes over
the process's original stdout (vLLM's own output is moved to stderr).

More: bench/pd/README.md (### pd_engine.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import sys
import time
from collections.abc import Callable
from typing import Any

from kvstore.bench.common.harness import exit_now

STAMPS: dict[str, list[Any]] = {"save_ends": [], "completes": [], "waits": [], "fetch_ends": []}


def _instrument() -> None:
    """Wraps the client calls whose times define the handoff (see the module docstring)."""
    from kvstore.client.adapters.vllm import pd_worker
    from kvstore.client.handoff import HandoffCalls
    from kvstore.client.layerwise.save import LayerSave

    run = LayerSave._run

    def timed_run(self: LayerSave) -> None:
        run(self)
        STAMPS["save_ends"].append([time.monotonic(), len(self.keys)])

    complete, wait = HandoffCalls.handoff_complete, HandoffCalls.handoff_wait

    async def timed_complete(self: Any, handoff_id: str, *args: Any, **kwargs: Any) -> int:
        start = time.monotonic()
        n = await complete(self, handoff_id, *args, **kwargs)
        STAMPS["completes"].append([handoff_id, start, time.monotonic(), n])
        return n

    async def timed_wait(self: Any, handoff_id: str, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        hit = await wait(self, handoff_id, *args, **kwargs)
        STAMPS["waits"].append([handoff_id, start, time.monotonic(), hit.num_pages])
        return hit

    fetch = pd_worker.HandoffWorker._fetch

    async def timed_fetch(self: Any, client: Any, spec: Any, *args: Any, **kwargs: Any) -> int:
        n = await fetch(self, client, spec, *args, **kwargs)
        STAMPS["fetch_ends"].append([spec.handoff_id, time.monotonic(), n])
        return n

    LayerSave._run = timed_run  # type: ignore[method-assign]
    HandoffCalls.handoff_complete = timed_complete  # type: ignore[method-assign]
    HandoffCalls.handoff_wait = timed_wait  # type: ignore[method-assign]
    pd_worker.HandoffWorker._fetch = timed_fetch  # type: ignore[method-assign]


def _pending(llm: Any) -> Callable[[], bool]:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return lambda: bool(scheduler.connector.has_pending_block_frees())


def _settle(llm: Any, pending: Callable[[], bool]) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    deadline = time.monotonic() + 120
    while pending() and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.001)
    if not get_kv_transfer_group().worker.wait_saves(60):
        raise RuntimeError("the connector's saves did not end")
    handoffs = get_kv_transfer_group().handoff_worker  # a prefill's completion ends after its blocks are back
    if handoffs is not None and not handoffs.wait_completions(60):
        raise RuntimeError("the connector's handoff completions did not end")
    stamps = {k: list(v) for k, v in STAMPS.items()}
    for v in STAMPS.values():
        v.clear()
    return stamps


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Runs the prompts to their end as ``LLM.generate`` does (stepping the engine), stamping
    the step at which each output token appeared."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    transfers = cmd.get("kv_transfer_params") or [None] * len(cmd["prompts"])
    start = time.monotonic()
    ids = []
    for i, (prompt, transfer) in enumerate(zip(cmd["prompts"], transfers)):
        params = SamplingParams(max_tokens=cmd.get("max_tokens", 1), temperature=0.0, ignore_eos=True,
                                skip_reading_prefix_cache=cmd.get("skip_prefix_cache", False) or None,
                                extra_args={"kv_transfer_params": transfer} if transfer else None)
        ids.append(f"bench-{time.monotonic_ns()}-{i}")
        engine.add_request(ids[-1], {"prompt_token_ids": prompt}, params)
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    last: dict[str, Any] = {}
    while len(last) < len(ids) or not all(o.finished for o in last.values()):
        for out in engine.step():
            now, seen = time.monotonic(), stamps.get(out.request_id)
            if seen is None:
                continue
            seen.extend([now] * (len(out.outputs[0].token_ids) - len(seen)))
            last[out.request_id] = out
    end = time.monotonic()
    outs = [last[rid] for rid in ids]
    return {"start": start, "end": end, "outputs": [{"tokens": list(o.outputs[0].token_ids), "token_times": stamps[o.request_id],
                                                      "num_cached_tokens": o.num_cached_tokens,
                                                      "kv_transfer_params": o.kv_transfer_params} for o in outs]}


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # OMP_WAIT_POLICY=PASSIVE (read when torch loads libgomp, below): a forward runs on 2 OpenMP threads whose
    # barriers spin by default, so with both engines and both nodes on the host's cores a thread preempted by any of
    # them leaves its partner spinning (a 1-token decode forward of 3-9 ms took 152 ms once, 76 ms of it on CPU);
    # the PD arms run two engines and the nodes' handoff work at once, the colocated arm one engine (DESIGN §12.7)
    for key, value in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_WAIT_POLICY": "PASSIVE"}.items():
        os.environ.setdefault(key, value)
    _instrument()
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if len(sys.argv) > 1:
        model_dir, config = sys.argv[1], json.loads(sys.argv[2])
    else:  # imported meanwhile; the model and the nodes are ready now (or the bench stopped: no line, or exit)
        first = json.loads(sys.stdin.readline() or '{"cmd": "exit"}')
        if first.get("cmd") == "exit":
            return
        model_dir, config = first["model"], first["config"]
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.client.adapters.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=config["extra"])
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              block_size=config["block_size"], max_model_len=config["max_model_len"], enable_prefix_caching=True,
              kv_transfer_config=transfer, max_num_batched_tokens=config["max_num_batched_tokens"], disable_log_stats=True)
    pending = _pending(llm)
    proto.write(json.dumps({"ready": True}) + "\n")
    while True:
        # as vllm serve's loop: step while the connector holds blocks, read commands between steps
        while pending() and not select.select([sys.stdin], [], [], 0)[0]:
            llm.llm_engine.step()
            time.sleep(0.001)
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "generate":
            reply = _generate(llm, cmd)
        elif cmd["cmd"] == "settle":
            reply = _settle(llm, pending)
        elif cmd["cmd"] == "pd_stats":
            reply = dataclasses.asdict(get_kv_transfer_group().handoff_worker.stats)
        else:
            reply = {"error": f"unknown command {cmd['cmd']}"}
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
    exit_now(0)  # vLLM shut down by its finalizer, less the interpreter's teardown of torch and vLLM (~2.5 s an engine)
