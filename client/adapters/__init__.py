"""Engine adapters: each maps one engine's KV cache objects to kvstore pages."""
