"""The engine runner: KV slots, buckets and padding, CUDA graphs, and the execution path of each step."""
