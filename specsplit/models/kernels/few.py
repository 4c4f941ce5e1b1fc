"""Triton kernels of the fused step for a few rows (specsplit.models.fused: verifies of short chains,
batches of a few decodes; specsplit.models.fused_head: a chain's steps), each row computed as the
one-token decode (kernels.decode) computes it:

  norm_gemv      Y = rms_norm(X) · Wᵀ        q|k|v, and the final norm + lm_head
  gate_up_silu   A = silu(rms_norm(X)·Gᵀ) * (rms_norm(X)·Uᵀ)
  gemv_residual  H' = H + A · Wᵀ            the o and down projections with the residual add
  row_attention  rotary, the new entries written, and each row's attention as the decode's at
                 its position: the committed entries, then the rows it sees, in the decode's order

A GEMV runs the decode's code for each (row, column tile), with the decode's pinned blocks: a
row's sums are the decode's, in the same order, so a row computes the decode's bits whatever the
rows beside it. The rows of one column tile are neighbouring programs, so their weight reads meet
in L2: the weights cross HBM about once for all rows, as for one.

Attention gives each row the keys a decode at its position would see, in the same places: the
committed entries [0, start) from the cache, then the step's rows the row's mask shows (its
ancestors, in order: a chain's earlier rows, a tree node's path) at entries start, start + 1, ...,
taken from the step's q|k|v (rotated as the decode rotates them) rather than the cache, which
other programs of the step are still writing. Blocks of keys, the new key first, the online
softmax: the decode's (kernels.decode._attend), over the same ranges of keys as the decode at
that position (decode.key_range) with the counters. So a chain verified on this path, or a batch of
a few sequences decoding, gives each row the logits that one-token decodes give, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from specsplit.models.fused import FEW_ROWS_MAX
from specsplit.models.kernels import decode
from specsplit.models.kernels.decode import (
    ATTENTION_BLOCK,
    KEY_RANGES,
    _launch,
    _rotate,
    _softmax_block,
    _wait,
    gate_up_silu_tile,
    gemv_residual_tile,
    hand_over,
    key_range,
    norm_gemv_tile,
)


# Programs: (row, column tile), the row fastest: a tile's rows run side by side.
@triton.jit
def _few_norm_gemv(x_ptr, nw_ptr, w_ptr, y_ptr, N, K: tl.constexpr, K_SUM, stride_xm, stride_wn, stride_ym, eps,
                   HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0)
    norm_gemv_tile(x_ptr + r * stride_xm, nw_ptr, w_ptr, y_ptr + r * stride_ym, tl.program_id(1), N, K, K_SUM,
                   stride_wn, eps, HAS_NORM, USE_PDL, BLOCK_N, BLOCK_K)


@triton.jit
def _few_gate_up_silu(x_ptr, nw_ptr, w_ptr, y_ptr, N, K: tl.constexpr, K_SUM, stride_xm, stride_wn, eps,
                      USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0)
    gate_up_silu_tile(x_ptr + r * stride_xm, nw_ptr, w_ptr, y_ptr + r * N, tl.program_id(1), N, K, K_SUM, stride_wn,
                      eps, USE_PDL, BLOCK_N, BLOCK_K)


@triton.jit
def _few_gemv_residual(x_ptr, w_ptr, res_ptr, y_ptr, N, K: tl.constexpr, stride_xm, stride_wn, USE_PDL: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0)
    gemv_residual_tile(x_ptr + r * stride_xm, w_ptr, res_ptr + r * N, y_ptr + r * N, tl.program_id(1), N, K,
                       stride_wn, USE_PDL, BLOCK_N, BLOCK_K)


@triton.jit
def _ancestors(kb, vb, keys, start, qkv_row0, stride_qkv, mask_row, pos_row0, cos_ptr, sin_ptr, d, i, T, kvh,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, TP: tl.constexpr):
    """Keys and values [BLOCK_S, D] at logical entries `keys` with the step's rows that row i sees
    put at start, start + 1, ... in their order, as the decode's cache holds them."""
    half: tl.constexpr = D // 2
    dt = qkv_row0.dtype.element_ty
    rank = start
    for j in tl.static_range(TP):
        seen = (j < T) & (j != i)
        seen = seen & (tl.load(mask_row + j, mask=j < T, other=0) != 0)
        if seen:
            p = tl.load(pos_row0 + j)
            cos = tl.load(cos_ptr + p * D + d).to(dt).to(tl.float32)
            sin = tl.load(sin_ptr + p * D + d).to(dt).to(tl.float32)
            k_j = _rotate(qkv_row0 + j * stride_qkv + (HQ + kvh) * D, d, half, D, cos, sin)
            v_j = tl.load(qkv_row0 + j * stride_qkv + (HQ + HKV + kvh) * D + d)
            at = (keys == rank)[:, None]
            kb = tl.where(at, k_j[None, :].to(kb.dtype), kb)
            vb = tl.where(at, v_j[None, :].to(vb.dtype), vb)
        rank += seen.to(tl.int32)
    return kb, vb


@triton.jit
def _row_attention(qkv_ptr, stride_qkv, cos_ptr, sin_ptr, pos_ptr, entry_ptr, slot_ptr, mask_ptr, k_ptr, v_ptr,
                   out_ptr, part_ptr, c_ptr, stride_slot, stride_pos, T, HQ: tl.constexpr, HKV: tl.constexpr,
                   D: tl.constexpr, scale, USE_PDL: tl.constexpr, BLOCK_S: tl.constexpr, TP: tl.constexpr,
                   SPLITS: tl.constexpr):
    """One program per (query head, row, range of keys); rows of B sequences of T; a row's keys
    split in ranges as the decode at its position splits them (decode.key_range)."""
    h, row, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, i = row // T, row % T
    kvh = h // (HQ // HKV)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    # everything written before the step (positions, entries, slot, mask, rotary tables, the
    # committed keys and values of the first block): read before waiting for the previous kernel
    start = tl.load(entry_ptr + b * T)  # committed entries [0, start); the rows' at start..start+T-1
    mask_row = mask_ptr + row * T  # [T]: the rows row i sees
    jj = tl.arange(0, TP)
    shown = (tl.load(mask_row + jj, mask=jj < T, other=0) != 0) & (jj != i) & (jj < T)
    pos_keys = start + tl.sum(shown.to(tl.int32), axis=0)  # the keys before this row's own, as a decode's `pos`
    n, lo, hi = key_range(pos_keys, r, SPLITS, BLOCK_S)  # this program's keys [lo, hi)
    if r < n:
        pos = tl.load(pos_ptr + row)
        slot = tl.load(slot_ptr + b)
        dt = qkv_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + pos * D + d).to(dt).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + d).to(dt).to(tl.float32)
        k_base = k_ptr + slot * stride_slot + kvh * D
        v_base = v_ptr + slot * stride_slot + kvh * D
        s = lo + tl.arange(0, BLOCK_S)
        ok = s < hi
        cached = (s < start)[:, None]
        kb = tl.load(k_base + s[:, None] * stride_pos + d[None, :], mask=cached, other=0.0)  # [BLOCK_S, D]
        vb = tl.load(v_base + s[:, None] * stride_pos + d[None, :], mask=cached, other=0.0)
        nxt = BLOCK_S + s  # the next block's committed entries too, as the decode's attention does
        k_nxt = tl.load(k_base + nxt[:, None] * stride_pos + d[None, :], mask=(nxt < start)[:, None], other=0.0)
        v_nxt = tl.load(v_base + nxt[:, None] * stride_pos + d[None, :], mask=(nxt < start)[:, None], other=0.0)
        _wait(USE_PDL)
        qkv_row0 = qkv_ptr + b * T * stride_qkv
        me = qkv_ptr + row * stride_qkv
        q = _rotate(me + h * D, d, half, D, cos, sin).to(tl.float32)
        if r == 0:  # the first range: the row's own key from registers, then its blocks
            k_new = _rotate(me + (HQ + kvh) * D, d, half, D, cos, sin)
            v_new = tl.load(me + (HQ + HKV + kvh) * D + d)
            if h % (HQ // HKV) == 0:  # one query head of the group stores the row's entry
                entry = start + i
                tl.store(k_base + entry * stride_pos + d, k_new.to(k_ptr.dtype.element_ty))
                tl.store(v_base + entry * stride_pos + d, v_new.to(v_ptr.dtype.element_ty))
            m = tl.sum(q * k_new.to(tl.float32), axis=0) * scale
            den = m * 0.0 + 1.0
            acc = v_new.to(tl.float32)
        else:
            den = tl.sum(q, axis=0) * 0.0
            m = den - float("inf")
            acc = q * 0.0
        if lo + BLOCK_S > start:
            kb, vb = _ancestors(kb, vb, s, start, qkv_row0, stride_qkv, mask_row, pos_ptr + b * T, cos_ptr, sin_ptr,
                                d, i, T, kvh, HQ, HKV, D, TP)
        m, den, acc = _softmax_block(kb, vb, ok, q, m, den, acc, scale)
        for s0 in range(lo + BLOCK_S, hi, BLOCK_S):
            keys = s0 + tl.arange(0, BLOCK_S)
            valid = keys < hi
            k_blk, v_blk = k_nxt, v_nxt
            after = keys + BLOCK_S
            k_nxt = tl.load(k_base + after[:, None] * stride_pos + d[None, :], mask=(after < start)[:, None],
                            other=0.0)
            v_nxt = tl.load(v_base + after[:, None] * stride_pos + d[None, :], mask=(after < start)[:, None],
                            other=0.0)
            if s0 + BLOCK_S > start:
                k_blk, v_blk = _ancestors(k_blk, v_blk, keys, start, qkv_row0, stride_qkv, mask_row, pos_ptr + b * T,
                                          cos_ptr, sin_ptr, d, i, T, kvh, HQ, HKV, D, TP)
            m, den, acc = _softmax_block(k_blk, v_blk, valid, q, m, den, acc, scale)
        if n == 1:
            tl.store(out_ptr + row * (HQ * D) + h * D + d, (acc / den).to(out_ptr.dtype.element_ty))
        else:
            last, o = hand_over(m, den, acc, part_ptr, c_ptr, row * HQ + h, r, n, d, D, SPLITS)
            if last:
                tl.store(out_ptr + row * (HQ * D) + h * D + d, o.to(out_ptr.dtype.element_ty))


_KERNELS = {"norm_gemv": _few_norm_gemv, "gate_up_silu": _few_gate_up_silu, "gemv_residual": _few_gemv_residual}


def _run(name: str, n: int, k: int, x: torch.Tensor, pdl: bool, *args: Any, **constants: Any) -> None:
    m = x.shape[0]
    if not 1 <= m <= FEW_ROWS_MAX:
        raise ValueError(f"the few-row kernels take 1..{FEW_ROWS_MAX} rows, got {m}")
    block_n, block_k, warps = decode.gemv_blocks(name, n, k, x.device)
    _KERNELS[name][(m, triton.cdiv(n, block_n))](*args, USE_PDL=pdl, **constants, BLOCK_N=block_n, BLOCK_K=block_k,
                                                 num_warps=warps, num_stages=3, **_launch(pdl))


def norm_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
              pdl: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] -> rms_norm(x, norm_weight) · weightᵀ [M, N] (no norm when norm_weight is None),
    rounded to x's dtype and stored as out_dtype (default: x's)."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    nw = x if norm_weight is None else norm_weight
    _run("norm_gemv", n, k, x, pdl, x, nw, weight, y, n, k, k, x.stride(0), weight.stride(0), y.stride(0), eps,
         HAS_NORM=norm_weight is not None)
    return y


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 pdl: bool = False) -> torch.Tensor:
    """x [M, K], weight [2I, K] (gate; up) -> silu(n·gateᵀ) * (n·upᵀ) [M, I], n = rms_norm(x)."""
    (m, k), n = x.shape, weight.shape[0] // 2
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _run("gate_up_silu", n, k, x, pdl, x, norm_weight, weight, y, n, k, k, x.stride(0), weight.stride(0), eps)
    return y


def gemv_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [M, K], weight [N, K], residual [M, N] (contiguous) -> residual + x · weightᵀ [M, N]."""
    k, n = x.shape[1], weight.shape[0]
    if not residual.is_contiguous():
        raise ValueError("gemv_residual reads the residual as a contiguous [M, N]")
    y = torch.empty_like(residual)
    _run("gemv_residual", n, k, x, pdl, x, weight, residual, y, n, k, x.stride(0), weight.stride(0))
    return y


def row_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  entries: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, pdl: bool = False,
                  counters: torch.Tensor | None = None) -> torch.Tensor:
    """B sequences of T tokens: qkv [B*T, (Hq + 2 Hkv) * D] at rotary `positions` [B*T], written
    to KV entries `entries` [B, T] (each row consecutive: only its first is read) of `slots` [B];
    mask [B, T, T] (nonzero: token i sees new token j of its sequence: its ancestors, listed
    before it); k_cache, v_cache [slots, max_len, Hkv, D] of this layer -> [B*T, Hq * D], each
    row as kernels.decode.rope_attention computes it at the row's position after its ancestors
    (with `counters`, ≥ B·T·Hq int32 zeros left at zero, as it does with them: its keys split in
    ranges)."""
    (b, t), d = entries.shape, k_cache.shape[-1]
    if b * t > FEW_ROWS_MAX:
        raise ValueError(f"row_attention takes at most {FEW_ROWS_MAX} rows, got {b * t}")
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or cos.shape[-1] != d:
        raise ValueError("row_attention needs a contiguous [slots, max_len, kv_heads, head_dim] cache")
    if qkv.shape[0] != b * t or mask.shape != (b, t, t) or not mask.is_contiguous():
        raise ValueError(f"row_attention: {qkv.shape[0]} rows for entries {tuple(entries.shape)} and mask "
                         f"{tuple(mask.shape)} (contiguous)")
    if not (entries.is_contiguous() and positions.is_contiguous() and slots.is_contiguous()):
        raise ValueError("row_attention reads entries, positions and slots as contiguous tensors")
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    splits = KEY_RANGES if counters is not None else 1
    if counters is not None and counters.numel() < b * t * num_heads:
        raise ValueError(f"row_attention needs {b * t * num_heads} counters, got {counters.numel()}")
    out = torch.empty(b * t, num_heads * d, device=qkv.device, dtype=qkv.dtype)
    parts = torch.empty(b * t * num_heads * splits * (d + 2) if splits > 1 else 1, device=qkv.device,
                        dtype=torch.float32)
    block, warps = ATTENTION_BLOCK
    _row_attention[(num_heads, b * t, splits)](qkv, qkv.stride(0), cos, sin, positions, entries, slots, mask,
                                               k_cache, v_cache, out, parts, counters if counters is not None
                                               else parts, k_cache.stride(0), k_cache.stride(1), t, HQ=num_heads,
                                               HKV=num_kv_heads, D=d, scale=d ** -0.5, USE_PDL=pdl, BLOCK_S=block,
                                               TP=max(2, triton.next_power_of_2(t)), SPLITS=splits,
                                               num_warps=warps, **_launch(pdl))
    return out
