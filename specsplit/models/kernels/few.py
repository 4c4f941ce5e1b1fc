"""Triton kernels of the fused step for a few rows (specsplit.models.fused: verifies of short chains,
batches of a few decodes) on the CUDA cores: the decode's GEMVs (kernels.decode) taking up to
FEW_ROWS rows at once.

  norm_gemv      Y = rms_norm(X) · Wᵀ        q|k|v, and the final norm + lm_head
  gate_up_silu   A = silu(rms_norm(X)·Gᵀ) * (rms_norm(X)·Uᵀ)
  gemv_residual  H' = H + A · Wᵀ            the o and down projections with the residual add

A program loads its rows of W across the whole of K in one tile (before the wait for the previous
kernel, with PDL), then computes each row of X against it in turn: the weights are read once for
all rows, as a decode reads them for one, and no row waits for a tensor-core tile of 16. Each
row's arithmetic is the decode's (the same tile, the same order of sums, the norm folded in the
same way), so a row computes the same bits whatever the number of rows beside it, and the same
bits as the decode kernels give with the same blocks. Whole-K tiles bound K (WHOLE_K): wider
projections keep the tensor-core path (kernels.projections).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from specsplit.models.kernels import blocks
from specsplit.models.kernels.decode import _gpu, _launch, _wait

FEW_ROWS = 8  # rows of a step at most (the rows loop is unrolled)
WHOLE_K = 4096  # the widest K a tile covers


@triton.jit
def _whole(rows_ptr, row_ok, K, BLOCK_K: tl.constexpr):
    """This program's rows of W over all of K [BLOCK_N, BLOCK_K], in fp32."""
    cols = tl.arange(0, BLOCK_K)
    return tl.load(rows_ptr + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _norm_weight(nw_ptr, K, BLOCK_K: tl.constexpr):
    """The RMS norm's weight [BLOCK_K] in fp32 (loaded once for all rows, before the wait)."""
    cols = tl.arange(0, BLOCK_K)
    return tl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _row(x_ptr, nw, r, M, K, stride_xm, HAS_NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row r of X as (x·nw, Σ x²) in fp32 (x and 0 without a norm); zeros past the M rows."""
    cols = tl.arange(0, BLOCK_K)
    ok = (cols < K) & ((cols * 0 + r) < M)
    x = tl.load(x_ptr + r * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        return x * nw, tl.sum(x * x, axis=0)
    return x, 0.0


@triton.jit
def _few_norm_gemv(x_ptr, nw_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, eps,
                   HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w = _whole(w_ptr + n[:, None] * stride_wn, n_ok, K, BLOCK_K)
    nw = _norm_weight(nw_ptr, K, BLOCK_K) if HAS_NORM else 1.0
    _wait(USE_PDL)
    for r in tl.static_range(ROWS):
        x, sq = _row(x_ptr, nw, r, M, K, stride_xm, HAS_NORM, BLOCK_K)
        y = tl.sum(w * x[None, :], axis=1)
        if HAS_NORM:
            y = y * tl.rsqrt(sq / K + eps)
        tl.store(y_ptr + r * stride_ym + n, y.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty),
                 mask=n_ok & ((n * 0 + r) < M))


@triton.jit
def _few_gate_up_silu(x_ptr, nw_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, eps, USE_PDL: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w [2N, K]: gate rows, then up rows."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    wg = _whole(w_ptr + n[:, None] * stride_wn, n_ok, K, BLOCK_K)
    wu = _whole(w_ptr + (n + N)[:, None] * stride_wn, n_ok, K, BLOCK_K)
    nw = _norm_weight(nw_ptr, K, BLOCK_K)
    _wait(USE_PDL)
    dt = y_ptr.dtype.element_ty
    for r in tl.static_range(ROWS):
        x, sq = _row(x_ptr, nw, r, M, K, stride_xm, True, BLOCK_K)
        rstd = tl.rsqrt(sq / K + eps)
        g = (tl.sum(wg * x[None, :], axis=1) * rstd).to(dt).to(tl.float32)  # the GEMM's rounded outputs
        u = (tl.sum(wu * x[None, :], axis=1) * rstd).to(dt).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(y_ptr + r * N + n, (silu * u).to(dt), mask=n_ok & ((n * 0 + r) < M))


@triton.jit
def _few_gemv_residual(x_ptr, w_ptr, res_ptr, y_ptr, M, N, K, stride_xm, stride_wn, USE_PDL: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w = _whole(w_ptr + n[:, None] * stride_wn, n_ok, K, BLOCK_K)
    _wait(USE_PDL)
    dt = y_ptr.dtype.element_ty
    for r in tl.static_range(ROWS):
        x, _ = _row(x_ptr, 1.0, r, M, K, stride_xm, False, BLOCK_K)
        ok = n_ok & ((n * 0 + r) < M)
        y = tl.sum(w * x[None, :], axis=1).to(dt).to(tl.float32)
        y += tl.load(res_ptr + r * N + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * N + n, y.to(dt), mask=ok)


_KERNELS = {"norm_gemv": _few_norm_gemv, "gate_up_silu": _few_gate_up_silu, "gemv_residual": _few_gemv_residual}


def supported(*ks: int) -> bool:
    """Whether projections of these K fit whole-K tiles."""
    return max(ks) <= WHOLE_K


def whole_blocks(name: str, n: int, k: int, gpu: str) -> blocks.Blocks:
    """The decode's pinned blocks where their tile covers K (then a row's bits are the decode's), else
    a whole-K tile of about 8192 weights a program."""
    b = blocks.lookup(name, n, k, gpu)
    if b[1] >= k:
        return b
    block_k = triton.next_power_of_2(k)
    return max(1, 8192 // block_k), block_k, 8


def _run(name: str, n: int, k: int, x: torch.Tensor, pdl: bool, *args: Any, **constants: Any) -> None:
    m = x.shape[0]
    if not 1 <= m <= FEW_ROWS or not supported(k):
        raise ValueError(f"the few-row kernels take 1..{FEW_ROWS} rows of K <= {WHOLE_K}, got {m} of {k}")
    gpu = _gpu(x.device.index or 0) if x.device.type == "cuda" else "interpreter"
    block_n, block_k, warps = whole_blocks(name, n, k, gpu)
    _KERNELS[name][(triton.cdiv(n, block_n),)](*args, USE_PDL=pdl, ROWS=triton.next_power_of_2(m), **constants,
                                               BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                               **_launch(pdl))


def norm_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
              pdl: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] -> rms_norm(x, norm_weight) · weightᵀ [M, N] (no norm when norm_weight is None),
    rounded to x's dtype and stored as out_dtype (default: x's)."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    nw = x if norm_weight is None else norm_weight
    _run("norm_gemv", n, k, x, pdl, x, nw, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), eps,
         HAS_NORM=norm_weight is not None)
    return y


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 pdl: bool = False) -> torch.Tensor:
    """x [M, K], weight [2I, K] (gate; up) -> silu(n·gateᵀ) * (n·upᵀ) [M, I], n = rms_norm(x)."""
    (m, k), n = x.shape, weight.shape[0] // 2
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _run("gate_up_silu", n, k, x, pdl, x, norm_weight, weight, y, m, n, k, x.stride(0), weight.stride(0), eps)
    return y


def gemv_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [M, K], weight [N, K], residual [M, N] -> residual + x · weightᵀ [M, N]."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty_like(residual)
    _run("gemv_residual", n, k, x, pdl, x, weight, residual, y, m, n, k, x.stride(0), weight.stride(0))
    return y
