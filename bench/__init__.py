"""kvstore-bench: benchmarks that compare kvstore with the physical limits they chase."""
