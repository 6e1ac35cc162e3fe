"""`kvstore-bench cluster`: cluster mode on loopback; remote get GB/s per data plane beside raw pumps, sharded
lookup, failover, scaling; the balance simulation."""
