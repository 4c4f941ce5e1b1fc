"""Triton kernels of the fused target steps: `decode` for one token, `verify` for a chain or tree of tokens."""
