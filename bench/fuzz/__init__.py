"""`kvstore-bench fuzz`: random and mutated requests on every RPC with auth + TLS on; no crash, INTERNAL, hang
or leak, and the store still exact."""
