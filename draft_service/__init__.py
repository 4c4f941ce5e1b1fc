"""The draft service: an EAGLE-3 head on one device with its own KV cache."""
