"""A vLLM engine in its own process, driven by JSON lines (the tests' side: EngineProcess).

Usage: python vllm_engine.py MODEL_DIR CONFIG_JSON. The protocol goes over the process's
original stdout; vLLM's own output is moved to stderr.

Commands: {"cmd": "generate", "prompts": [[ids]], "max_tokens": n, "skip_prefix_cache": b, "ignore_eos": b}
-> {"outputs": [{"tokens", "logprobs", "num_cached_tokens"}], "seconds"} once the connector's
saves of the generation have ended and its sessions' tokens are logged (so that the next command finds what it stored);
"kv_transfer_params": [params or null per prompt] (disaggregated prefill: each output then
carries its own; "drain": true steps the engine until the connector gives every held block
back, as vllm serve's busy loop does, and waits for its handoffs' completions; {"cmd": "drain"}
does that alone);
{"cmd": "stats"} -> the worker connector's counters; {"cmd": "pd_stats"} -> its handoff counters (both: "rank": r, a
tensor-parallel rank's, 0 unless named; "tensor_parallel_size" in the config runs that many workers); {"cmd": "load_stats"} -> the scheduler
side's (tokens found, loaded, skipped as not worth loading; the fitted fetch and recompute lines); {"cmd": "kv_config"} -> the KV
cache groups, whether vLLM's hybrid KV cache manager is on, the connector's page layout and vLLM's block size;
{"cmd": "hooks", ...} sets vllm_hooks' switches; {"cmd": "metrics"} -> vLLM's counters named vllm:kvstore_*
(``LLM.get_metrics()``, its Prometheus registry; the config needs "log_stats": true); {"cmd": "exit"}.
Live migration: {"cmd": "start", "prompt", "max_tokens", "kv_transfer_params", "pause_after": n} adds one greedy
request (eos ignored) and steps the engine until it output n tokens, then waits until the connector logged every
token and its saves ended -> {"tokens"}; {"cmd": "resume"} steps it to its end -> {"tokens", "finish_reason",
"stop_reason"}; {"cmd": "session_stats"} -> the scheduler connector's session counters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _stats(_worker: object, handoffs: bool) -> dict:
    """In a worker's process (``LLM.collective_rpc``: each tensor-parallel rank runs its own connector): its counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    return dataclasses.asdict(connector.handoff_worker.stats if handoffs else connector.worker.stats)


def _wait_saves(_worker: object, timeout_s: float) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return bool(get_kv_transfer_group().worker.wait_saves(timeout_s))


def _wait_completions(_worker: object, timeout_s: float) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    handoffs = getattr(get_kv_transfer_group(), "handoff_worker", None)
    return handoffs is None or bool(handoffs.wait_completions(timeout_s))


def drain(llm: object) -> None:
    """Steps the engine until its connector holds no finished request's blocks, then waits for
    the handoffs' completions, which end in the background (at most 60 s in all), on every worker."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    deadline = time.monotonic() + 60
    while scheduler.connector.has_pending_block_frees() and time.monotonic() < deadline:
        llm.llm_engine.step()  # type: ignore[attr-defined]
    llm.collective_rpc(_wait_completions, args=(max(0.0, deadline - time.monotonic()),))  # type: ignore[attr-defined]


def step_request(llm: object, cmd: dict, paused: object) -> object:
    """"start": adds the request and steps until it output ``pause_after`` tokens, then has the
    connector log them and end its saves (what the engine's next steps would do), so that a
    migration sees them all; "resume": steps the paused request to its end. Its last output."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = llm.llm_engine  # type: ignore[attr-defined]
    until = cmd.get("pause_after", 1 << 30)
    request_id = getattr(paused, "request_id", "")
    if cmd["cmd"] == "start":
        paused, request_id = None, f"paused-{time.monotonic_ns()}"
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True,
                                extra_args={"kv_transfer_params": cmd["kv_transfer_params"]})
        engine.add_request(request_id, {"prompt_token_ids": cmd["prompt"]}, params)
    while paused is None or not (paused.finished or len(paused.outputs[0].token_ids) >= until):  # type: ignore[attr-defined]
        paused = next((o for o in engine.step() if o.request_id == request_id), paused)
    if cmd["cmd"] == "start":
        assert engine.engine_core.engine_core.scheduler.connector.sessions.flush(60), "the session's tokens were not logged"
        assert get_kv_transfer_group().worker.wait_saves(60), "the connector's saves did not end"
    return paused


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    model_dir, config = sys.argv[1], json.loads(sys.argv[2])

    import vllm_hooks
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = None
    if config.get("connector"):
        transfer = KVTransferConfig(kv_connector=config["connector"], kv_connector_module_path=config["module"],
                                    kv_role="kv_both", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config=config.get("extra", {}))
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=config.get("dtype", "float32"), enforce_eager=True, seed=0,
              block_size=config.get("block_size", 32), max_model_len=config.get("max_model_len", 1024),
              enable_prefix_caching=config.get("prefix_caching", False), kv_transfer_config=transfer,
              max_num_batched_tokens=config.get("max_num_batched_tokens", 4096),
              disable_log_stats=not config.get("log_stats", False),
              tensor_parallel_size=config.get("tensor_parallel_size", 1))
    proto.write(json.dumps({"ready": True}) + "\n")
    paused: object = None  # the request "start" paused, as its last RequestOutput
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "generate":
            transfers = cmd.get("kv_transfer_params") or [None] * len(cmd["prompts"])
            params = [SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0, logprobs=0,
                                     ignore_eos=cmd.get("ignore_eos", False),
                                     skip_reading_prefix_cache=cmd.get("skip_prefix_cache", False) or None,
                                     extra_args={"kv_transfer_params": t} if t else None) for t in transfers]
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            if cmd.get("drain"):
                drain(llm)
            if transfer is not None:
                assert all(llm.collective_rpc(_wait_saves, args=(60,))), "the connector's saves did not end"
                sessions = getattr(llm.llm_engine.engine_core.engine_core.scheduler.connector, "sessions", None)
                assert sessions is None or sessions.flush(60), "the sessions' tokens were not logged"
            reply = {"seconds": seconds, "outputs": [{
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                "num_cached_tokens": o.num_cached_tokens,
                "kv_transfer_params": o.kv_transfer_params,
            } for o in outs]}
        elif cmd["cmd"] in ("start", "resume"):
            paused = step_request(llm, cmd, paused)
            out = paused.outputs[0]  # type: ignore[attr-defined]
            reply = {"tokens": list(out.token_ids), "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        elif cmd["cmd"] == "session_stats":
            reply = dataclasses.asdict(llm.llm_engine.engine_core.engine_core.scheduler.connector.sessions.stats)
        elif cmd["cmd"] == "drain":
            drain(llm)
            reply = {}
        elif cmd["cmd"] in ("stats", "pd_stats"):
            reply = llm.collective_rpc(_stats, args=(cmd["cmd"] == "pd_stats",))[cmd.get("rank", 0)]
        elif cmd["cmd"] == "load_stats":  # the scheduler's connector (in this process: no engine-core process)
            policy = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler.policy
            reply = dataclasses.asdict(policy.stats) | {"fetch": dataclasses.asdict(policy.costs.fetch.line()),
                                                        "recompute": dataclasses.asdict(policy.costs.recompute.line())}
        elif cmd["cmd"] == "kv_config":  # the KV cache groups, whether vLLM's hybrid manager is on, the namespace
            connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
            layout = connector.store.namespace.layout
            reply = {"hybrid_manager": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
                     "groups": [type(g.kv_cache_spec).__name__ for g in connector._kv_cache_config.kv_cache_groups],
                     "layout": {**layout.describe(), "groups": list(layout.groups)},
                     "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
        elif cmd["cmd"] == "metrics":  # the connector's counters as an operator sees them (connector_stats.py), one engine
            from vllm.v1.metrics.reader import Counter

            reply = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter) and m.name.startswith("vllm:kvstore_")}
        elif cmd["cmd"] == "hooks":
            vllm_hooks.CORRUPT_LAYER[:] = [cmd["corrupt_layer"]] if cmd.get("corrupt_layer") is not None else []
            vllm_hooks.CORRUPT_STATE[:] = [True] if cmd.get("corrupt_state") else []
            vllm_hooks.PAUSE.clear()
            if cmd.get("pause"):
                vllm_hooks.PAUSE.update(cmd["pause"])
            reply = {}
        else:
            reply = {"error": f"unknown command {cmd['cmd']}"}
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
