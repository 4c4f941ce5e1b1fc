"""Triton kernels of the fused multi-row step (specsplit.models.fused, T > 1): the same
five kernels a layer as the one-token decode (specsplit.models.kernels.decode), for the T tokens of one
sequence that a verify sends through the target at once: a chain (causal) or a tree (each token
sees the committed entries, its ancestors and itself).

  norm_mm        Y = rms_norm(X) · Wᵀ          X [T, K], W [N, K]: q|k|v, and final norm + lm_head
  gate_up_silu   A = silu(rms_norm(X)·Gᵀ) * (rms_norm(X)·Uᵀ)
  mm_residual    H' = H + A · Wᵀ               the o and down projections with the residual add
  tree_attention rotary on q and k at each token's position, the T new k and v written to
                 entries start..start+T-1, attention over the committed entries [0, start) and
                 the new ones that `mask` [T, T] allows: one program per query head

A weight is read once for all T rows (a program's tile of W times the rows padded to 16, on the
tensor cores), so a verify of 16 tokens streams the same bytes as a decode of one. The RMS norm
is folded in as in kernels.decode (rstd per row, its sum of squares accumulated in the same pass).
fp32 models multiply in IEEE fp32 (no TF32), so they agree with the unfused model to fp32 rounding.

At SmolLM2's shape on an H200 a 16-token verify costs ~2.3x a fused decode (docs/benchmarks.md):
tl.dot's tiles of 16 output columns leave ~36 programs for a 576-wide projection, each looping
over K with one tile in flight, so the kernels are latency-bound.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from specsplit.models.kernels.decode import _launch, _tile, _wait

MAX_ROWS = 64  # tokens a fused verify takes (register budget of tree_attention's [rows, head_dim] tiles)


def _configs() -> list[Any]:
    """Block shapes tried once per (M, N, K): tl.dot needs tiles of at least 16. With N as small
    as 576 there are few programs, so a step is the latency of each program's serial loop over
    K: long tiles (fewer iterations) with more warps are among the candidates."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64})]
    shapes = ((16, 128, 4), (16, 256, 4), (16, 512, 8), (16, 1024, 8), (32, 128, 4), (32, 512, 8), (64, 64, 4),
              (64, 128, 8))
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=3) for n, k, w in shapes]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (bf16/fp16 operands ignore it)


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


@triton.jit
def _rows_mm(x_ptr, nw_ptr, w_ptr, M, N, K, stride_xm, stride_wn, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr,
             DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's columns of (X·nw) · Wᵀ: (rows m, m_ok, columns n, n_ok, acc [BLOCK_M,
    BLOCK_N] fp32, Σ x² per row [BLOCK_M] — 0 without a norm)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    w_rows = w_ptr + n[:, None] * stride_wn
    w = _tile(w_rows, n_ok, 0, K, BLOCK_K)  # [BLOCK_N, BLOCK_K]: before the wait, as in decode
    _wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        if HAS_NORM:
            sq += tl.sum(x * x, axis=1)
            x = x * tl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=DOT)
        w = _tile(w_rows, n_ok, k0 + BLOCK_K, K, BLOCK_K)
    return m, m_ok, n, n_ok, acc, sq


@triton.autotune(configs=_configs(), key=["M", "N", "K"])
@triton.jit
def _norm_mm(x_ptr, nw_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, eps, HAS_NORM: tl.constexpr,
             USE_PDL: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    m, m_ok, n, n_ok, y, sq = _rows_mm(x_ptr, nw_ptr, w_ptr, M, N, K, stride_xm, stride_wn, HAS_NORM, USE_PDL, DOT,
                                       BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_NORM:
        y = y * tl.rsqrt(sq / K + eps)[:, None]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.autotune(configs=_configs(), key=["M", "N", "K"])
@triton.jit
def _gate_up_silu_mm(x_ptr, nw_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, eps, USE_PDL: tl.constexpr,
                     DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w [2N, K]: gate rows, then up rows; a program's gate and up tiles stream in the same pass."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    g_rows = w_ptr + n[:, None] * stride_wn
    u_rows = w_ptr + (n + N)[:, None] * stride_wn
    wg = _tile(g_rows, n_ok, 0, K, BLOCK_K)
    wu = _tile(u_rows, n_ok, 0, K, BLOCK_K)
    _wait(USE_PDL)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        sq += tl.sum(x * x, axis=1)
        xn = (x * tl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]).to(wg.dtype)
        acc_g = tl.dot(xn, tl.trans(wg), acc_g, input_precision=DOT)
        acc_u = tl.dot(xn, tl.trans(wu), acc_u, input_precision=DOT)
        wg = _tile(g_rows, n_ok, k0 + BLOCK_K, K, BLOCK_K)
        wu = _tile(u_rows, n_ok, k0 + BLOCK_K, K, BLOCK_K)
    rstd = tl.rsqrt(sq / K + eps)[:, None]
    dt = y_ptr.dtype.element_ty
    g = (acc_g * rstd).to(dt).to(tl.float32)  # the GEMM's rounded outputs
    u = (acc_u * rstd).to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + m[:, None] * N + n[None, :], (silu * u).to(dt), mask=m_ok[:, None] & n_ok[None, :])


@triton.autotune(configs=_configs(), key=["M", "N", "K"])
@triton.jit
def _mm_residual(x_ptr, w_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, USE_PDL: tl.constexpr,
                 DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m, m_ok, n, n_ok, y, _ = _rows_mm(x_ptr, x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, False, USE_PDL, DOT,
                                      BLOCK_M, BLOCK_N, BLOCK_K)
    dt = y_ptr.dtype.element_ty
    at = m[:, None] * N + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    y = y.to(dt).to(tl.float32) + tl.load(r_ptr + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + at, y.to(dt), mask=ok)


@triton.jit
def _rotate_rows(ptr, stride, r, r_ok, d, half: tl.constexpr, D: tl.constexpr, cos, sin):
    """Rows r of x [T, D] at ptr: x·cos + rotate_half(x)·sin (sin signed), rounded as the unfused model."""
    dt = ptr.dtype.element_ty
    x = tl.load(ptr + r[:, None] * stride + d[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
    xr = tl.load(ptr + r[:, None] * stride + ((d + half) % D)[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
    return ((x * cos).to(dt).to(tl.float32) + xr * sin).to(dt)


@triton.jit
def _softmax_rows(scores, vb, m_i, den, acc, DOT: tl.constexpr):
    """Online softmax of scores [BLOCK_M, S] (-inf where hidden) against values vb [S, D]."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    acc = tl.dot(p.to(vb.dtype), vb, acc * alpha[:, None], input_precision=DOT)
    return m_new, den * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _tree_attention(qkv_ptr, stride_qkv, cos_ptr, sin_ptr, pos_ptr, entry_ptr, slot_ptr, mask_ptr, k_ptr, v_ptr,
                    out_ptr, stride_slot, stride_pos, T, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, scale,
                    USE_PDL: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    h = tl.program_id(0)
    kvh = h // (HQ // HKV)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    r = tl.arange(0, BLOCK_M)
    r_ok = r < T
    # inputs written before the graph ran (positions, entries, slot, mask, rotary tables, the
    # committed keys and values): read before waiting for the previous kernel
    pos = tl.load(pos_ptr + r, mask=r_ok, other=0)  # [BLOCK_M] rotary positions
    start = tl.load(entry_ptr)  # the tokens' KV entries are start..start+T-1
    slot = tl.load(slot_ptr)
    seen = tl.load(mask_ptr + r[:, None] * T + r[None, :], mask=r_ok[:, None] & r_ok[None, :], other=0) != 0
    seen = seen | (r[:, None] == r[None, :])  # padding rows see themselves: no row is all -inf
    dt = qkv_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos[:, None] * D + d[None, :]).to(dt).to(tl.float32)  # [BLOCK_M, D]
    sin = tl.load(sin_ptr + pos[:, None] * D + d[None, :]).to(dt).to(tl.float32)
    k_base = k_ptr + slot * stride_slot + kvh * D
    v_base = v_ptr + slot * stride_slot + kvh * D
    s = tl.arange(0, BLOCK_S)
    ok = s < start
    kb = tl.load(k_base + s[:, None] * stride_pos + d[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_S, D]
    vb = tl.load(v_base + s[:, None] * stride_pos + d[None, :], mask=ok[:, None], other=0.0)
    _wait(USE_PDL)
    q = _rotate_rows(qkv_ptr + h * D, stride_qkv, r, r_ok, d, half, D, cos, sin)  # [BLOCK_M, D]
    k_new = _rotate_rows(qkv_ptr + (HQ + kvh) * D, stride_qkv, r, r_ok, d, half, D, cos, sin)
    v_new = tl.load(qkv_ptr + r[:, None] * stride_qkv + (HQ + HKV + kvh) * D + d[None, :], mask=r_ok[:, None],
                    other=0.0)
    if h % (HQ // HKV) == 0:  # one query head of the group stores the new entries
        at = (start + r)[:, None] * stride_pos + d[None, :]
        tl.store(k_base + at, k_new.to(k_ptr.dtype.element_ty), mask=r_ok[:, None])
        tl.store(v_base + at, v_new.to(v_ptr.dtype.element_ty), mask=r_ok[:, None])
    # the new keys from registers (as the mask allows), then the committed entries block by block
    scores = tl.where(seen, tl.dot(q, tl.trans(k_new), input_precision=DOT) * scale, float("-inf"))
    m_i = tl.max(scores, axis=1)
    p = tl.exp(scores - m_i[:, None])
    den = tl.sum(p, axis=1)
    acc = tl.dot(p.to(v_new.dtype), v_new, input_precision=DOT)  # [BLOCK_M, D] fp32
    scores = tl.where(ok[None, :], tl.dot(q, tl.trans(kb), input_precision=DOT) * scale, float("-inf"))
    m_i, den, acc = _softmax_rows(scores, vb, m_i, den, acc, DOT)
    for s0 in range(BLOCK_S, start, BLOCK_S):
        keys = s0 + tl.arange(0, BLOCK_S)
        valid = keys < start
        k_blk = tl.load(k_base + keys[:, None] * stride_pos + d[None, :], mask=valid[:, None], other=0.0)
        v_blk = tl.load(v_base + keys[:, None] * stride_pos + d[None, :], mask=valid[:, None], other=0.0)
        blk = tl.where(valid[None, :], tl.dot(q, tl.trans(k_blk), input_precision=DOT) * scale, float("-inf"))
        m_i, den, acc = _softmax_rows(blk, v_blk, m_i, den, acc, DOT)
    out = acc / den[:, None]
    tl.store(out_ptr + r[:, None] * (HQ * D) + h * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None])


ATTENTION_BLOCK = (64, 4)  # committed keys per iteration, warps


def _grid(n: int) -> Any:
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)


def _constants(x: torch.Tensor, pdl: bool) -> dict[str, Any]:
    return {"USE_PDL": pdl, "DOT": _precision(x.dtype), "BLOCK_M": _block_m(x.shape[0]), **_launch(pdl)}


def norm_mm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, pdl: bool = False,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] -> rms_norm(x, norm_weight) · weightᵀ [T, N] (no norm when norm_weight is None),
    rounded to x's dtype and stored as out_dtype (default: x's)."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    nw = x if norm_weight is None else norm_weight
    _norm_mm[_grid(n)](x, nw, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), eps,
                       HAS_NORM=norm_weight is not None, **_constants(x, pdl))
    return y


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 pdl: bool = False) -> torch.Tensor:
    """x [T, K], weight [2I, K] (gate; up) -> silu(n·gateᵀ) * (n·upᵀ) [T, I], n = rms_norm(x)."""
    (m, k), n = x.shape, weight.shape[0] // 2
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _gate_up_silu_mm[_grid(n)](x, norm_weight, weight, y, m, n, k, x.stride(0), weight.stride(0), eps,
                               **_constants(x, pdl))
    return y


def mm_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [T, K], weight [N, K], residual [T, N] -> residual + x · weightᵀ [T, N]."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty_like(residual)
    _mm_residual[_grid(n)](x, weight, residual, y, m, n, k, x.stride(0), weight.stride(0), **_constants(x, pdl))
    return y


def tree_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   entries: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, pdl: bool = False) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] of T tokens at rotary `positions` [T], written to KV entries
    `entries` [T] (consecutive: only the first is read) of slot `slot` [1]; mask [T, T] (nonzero:
    token i sees new token j); k_cache, v_cache [slots, max_len, Hkv, D] of this layer. Every
    token sees the committed entries [0, entries[0]) -> [T, Hq * D]."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or cos.shape[-1] != d or not mask.is_contiguous():
        raise ValueError("tree_attention needs a contiguous [slots, max_len, kv_heads, head_dim] cache and mask")
    out = torch.empty(t, num_heads * d, device=qkv.device, dtype=qkv.dtype)
    block, warps = ATTENTION_BLOCK
    _tree_attention[(num_heads,)](qkv, qkv.stride(0), cos, sin, positions, entries, slot, mask, k_cache, v_cache, out,
                                  k_cache.stride(0), k_cache.stride(1), t, HQ=num_heads, HKV=num_kv_heads, D=d,
                                  scale=d ** -0.5, BLOCK_S=block, num_warps=warps, **_constants(qkv, pdl))
    return out
