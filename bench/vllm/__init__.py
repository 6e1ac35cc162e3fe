"""vLLM with kvstore: TTFT of a hit vs recompute vs vLLM's prefix cache (`vllm`), the decode stall of a big
hit (`vllm-stall`)."""
