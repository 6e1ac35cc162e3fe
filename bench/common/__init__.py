"""What the benchmarks share: server processes and ports (harness), etcd and cluster nodes (cluster_procs), the
physical limits (limits: memcpy, raw disk; rawgrpc: a bare gRPC pump; linkproxy: an emulated link), CPU per GB beside
the floor (cpu_floor, proc_stat) and TLS + auth credentials (secure)."""
