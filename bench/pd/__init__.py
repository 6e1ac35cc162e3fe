"""`kvstore-bench pd`: disaggregated prefill on two vLLM engines; TTFT colocated / through the pool / direct,
the handoff beside bytes / link + fixed cost."""
