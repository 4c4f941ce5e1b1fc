"""A Triton GEMV for one-row projections (batch-1 decode), where cuBLAS reads the weights at
~74% of HBM bandwidth on the H200. Each program streams BLOCK_N whole weight rows
(coalesced along K, evicted first: weights are read once per step) and keeps a
[BLOCK_N, BLOCK_K] fp32 accumulator, reduced once at the end. Triton is imported lazily:
CPU builds of torch come without it."""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
               for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8) for s in (2, 4)
               if bn * bk <= 8192]

    @triton.autotune(configs=configs, key=["N", "K"])
    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)

    return gemv_kernel, triton.cdiv


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T -> [1, N] (F.linear without bias, one row, CUDA)."""
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [1, {k}] and a row-major weight, got {tuple(x.shape)}")
    kernel, cdiv = _kernel()
    x = x.contiguous()
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    kernel[lambda meta: (cdiv(n, meta["BLOCK_N"]),)](x, weight, y, n, k, weight.stride(0))
    return y
