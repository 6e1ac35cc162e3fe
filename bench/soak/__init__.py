"""`kvstore-bench soak`: N clients of two tenants with TLS + auth; RSS, p50/p99, bytes checked, and the cost
of TLS + auth."""
