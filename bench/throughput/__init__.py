"""`kvstore-bench throughput`: put/get GB/s per data path beside memcpy, raw disk and raw gRPC."""
