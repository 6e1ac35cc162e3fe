"""`kvstore-bench replay`: admission and eviction policies on a trace beside Belady's optimum; pooled vs
isolated servers."""
