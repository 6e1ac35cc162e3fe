"""`kvstore-bench migrate`: live migration of a growing session; the catch-up curve beside S0 / (copy - growth)
per link cap, and the pause."""
