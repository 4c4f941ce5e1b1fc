"""The target verify service: the full model, tensor-parallel, with its KV cache."""
