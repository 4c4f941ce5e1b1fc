"""Triton kernels of the fused one-token decode step (specsplit.models.fused): a decoder
layer in five kernels instead of ~20, which is what keeps a batch-1 decode near the HBM bound.

  norm_gemv      y = W · rms_norm(x)          the q|k|v projection, and the final norm + lm_head
  gate_up_silu   a = silu(G·n) * (U·n), n = rms_norm(x)   the MLP's first half
  gemv_residual  h' = h + W · a               the o and down projections with the residual add
  rope_attention rotary on q and k, the new k and v written to the KV cache, attention over
                 the slot's keys [0, pos]: a program per (query head, range of keys); a short
                 context is one range, a long one up to KEY_RANGES (key_range), the last
                 program of a head to finish combining their partial softmaxes in range order

Every GEMV streams whole weight rows (coalesced along K, evicted first: a weight is read once a
step) into an fp32 accumulator. K is a compile-time constant (a model has a few): up to 3 steps
over K (SmolLM2's matrices) are unrolled, which needs no loop-carried state and fewer registers
(20–96 a thread against 128–237 with a loop); more steps (the 8B shape's) loop, as unrolling
them spills registers. A kernel is compiled once per (K, blocks). The RMS norm is
folded in: rms_norm(x)·w = rstd · Σ W[n,k] x[k] nw[k], with rstd a scalar, so the sum of
squares accumulates in the same pass. Intermediate
results are rounded to the activations' dtype where the unfused model rounds them (GEMM
outputs, SiLU, the rotary products), so bf16 decoding stays close to it and fp32 decoding equal
to it within fp32 rounding.

With `pdl` the kernels are launched with programmatic dependent launch (Hopper and later): a
kernel's programs start while the previous kernel's last wave runs, load their first weight
tile (which depends on nothing computed), then wait (griddepcontrol.wait) for the previous
kernel before reading its output or writing anything; attention likewise reads the step's
position, the rotary tables and the first two blocks of earlier keys and values first, and each
block of its loop loads the next one before its softmax. CPU builds
of torch come without Triton, so only specsplit.models.fused imports this module, when
a fused step is made (TRITON_INTERPRET=1 runs these kernels on the CPU).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

from specsplit.models.kernels import blocks


@triton.jit
def _wait(use_pdl: tl.constexpr) -> None:
    if use_pdl:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _tile(rows_ptr, row_ok, k0, K, BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at columns k0..: fully masked (no traffic) past K."""
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(rows_ptr + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _input(x_ptr, nw_ptr, k0, K, HAS_NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """(x·nw, x²) at columns k0.. in fp32 (x, 0 without a norm)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    if HAS_NORM:
        return x * tl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32), x * x
    return x, x * 0.0


UNROLLED_STEPS = tl.constexpr(3)  # K steps unrolled up to this many (a loop past it: no register spills)


@triton.jit
def _dot_step(x_ptr, nw_ptr, w_rows, row_ok, w, acc, sq, k0, K: tl.constexpr, HAS_NORM: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """One K step: the products of tile `w` at columns k0.. into acc, x² into sq, and the next tile."""
    x, x2 = _input(x_ptr, nw_ptr, k0, K, HAS_NORM, BLOCK_K)
    acc += w.to(tl.float32) * x[None, :]
    sq += x2
    return acc, sq, _tile(w_rows, row_ok, k0 + BLOCK_K, K, BLOCK_K)


# Each GEMV loads its first weight tile before waiting for the previous kernel (weights depend
# on nothing computed), then prefetches tile i+1 while it multiplies tile i.
@triton.jit
def _rows_dot(x_ptr, nw_ptr, w_ptr, pid, N, K: tl.constexpr, stride_wn, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows pid·BLOCK_N.. of W · (x·nw): (rows, row_ok, the dot products [BLOCK_N] in fp32,
    Σ x² — 0 without a norm)."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows[:, None] * stride_wn
    w = _tile(w_rows, row_ok, 0, K, BLOCK_K)
    _wait(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    if K <= UNROLLED_STEPS * BLOCK_K:  # (decided when compiled: K is a constant)
        for k0 in tl.static_range(0, K, BLOCK_K):
            acc, sq, w = _dot_step(x_ptr, nw_ptr, w_rows, row_ok, w, acc, sq, k0, K, HAS_NORM, BLOCK_K)
    else:
        for k0 in range(0, K, BLOCK_K):
            acc, sq, w = _dot_step(x_ptr, nw_ptr, w_rows, row_ok, w, acc, sq, k0, K, HAS_NORM, BLOCK_K)
    return rows, row_ok, tl.sum(acc, axis=1), tl.sum(sq, axis=0)


# The bodies take their column tile `pid` (kernels.few runs them over several rows of x, the same
# arithmetic for each row as here).
@triton.jit
def norm_gemv_tile(x_ptr, nw_ptr, w_ptr, y_ptr, pid, N, K: tl.constexpr, K_SUM, stride_wn, eps, HAS_NORM: tl.constexpr,
                   USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, row_ok, y, sq = _rows_dot(x_ptr, nw_ptr, w_ptr, pid, N, K, stride_wn, HAS_NORM, USE_PDL, BLOCK_N,
                                    BLOCK_K)
    if HAS_NORM:
        y = y * tl.rsqrt(sq / K_SUM + eps)  # K at run time: a division, not a constant's reciprocal
    # rounded to the activations' dtype, as the unfused GEMM's output, even into a float32 `out`
    tl.store(y_ptr + rows, y.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gate_up_step(x_ptr, nw_ptr, g_rows, u_rows, row_ok, wg, wu, acc_g, acc_u, sq, k0, K: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    x, x2 = _input(x_ptr, nw_ptr, k0, K, True, BLOCK_K)
    acc_g += wg.to(tl.float32) * x[None, :]
    acc_u += wu.to(tl.float32) * x[None, :]
    sq += x2
    return acc_g, acc_u, sq, _tile(g_rows, row_ok, k0 + BLOCK_K, K, BLOCK_K), _tile(u_rows, row_ok, k0 + BLOCK_K, K,
                                                                                     BLOCK_K)


@triton.jit
def gate_up_silu_tile(x_ptr, nw_ptr, w_ptr, y_ptr, pid, N, K: tl.constexpr, K_SUM, stride_wn, eps,
                      USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w [2N, K]: gate rows, then up rows (MergedColumnParallelLinear's layout)."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    g_rows = w_ptr + rows[:, None] * stride_wn
    u_rows = w_ptr + (rows + N)[:, None] * stride_wn
    wg = _tile(g_rows, row_ok, 0, K, BLOCK_K)
    wu = _tile(u_rows, row_ok, 0, K, BLOCK_K)
    _wait(USE_PDL)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    if K <= UNROLLED_STEPS * BLOCK_K:
        for k0 in tl.static_range(0, K, BLOCK_K):
            acc_g, acc_u, sq, wg, wu = _gate_up_step(x_ptr, nw_ptr, g_rows, u_rows, row_ok, wg, wu, acc_g, acc_u, sq,
                                                     k0, K, BLOCK_K)
    else:
        for k0 in range(0, K, BLOCK_K):
            acc_g, acc_u, sq, wg, wu = _gate_up_step(x_ptr, nw_ptr, g_rows, u_rows, row_ok, wg, wu, acc_g, acc_u, sq,
                                                     k0, K, BLOCK_K)
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / K_SUM + eps)
    dt = y_ptr.dtype.element_ty
    g = (tl.sum(acc_g, axis=1) * rstd).to(dt).to(tl.float32)  # the GEMM's rounded outputs
    u = (tl.sum(acc_u, axis=1) * rstd).to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + rows, (silu * u).to(dt), mask=row_ok)


@triton.jit
def gemv_residual_tile(x_ptr, w_ptr, r_ptr, y_ptr, pid, N, K: tl.constexpr, stride_wn, USE_PDL: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, row_ok, y, _ = _rows_dot(x_ptr, x_ptr, w_ptr, pid, N, K, stride_wn, False, USE_PDL, BLOCK_N, BLOCK_K)
    dt = y_ptr.dtype.element_ty
    y = y.to(dt).to(tl.float32) + tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(dt), mask=row_ok)


@triton.jit
def _norm_gemv(x_ptr, nw_ptr, w_ptr, y_ptr, N, K: tl.constexpr, K_SUM, stride_wn, eps, HAS_NORM: tl.constexpr,
               USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    norm_gemv_tile(x_ptr, nw_ptr, w_ptr, y_ptr, tl.program_id(0), N, K, K_SUM, stride_wn, eps, HAS_NORM, USE_PDL,
                   BLOCK_N, BLOCK_K)


@triton.jit
def _gate_up_silu(x_ptr, nw_ptr, w_ptr, y_ptr, N, K: tl.constexpr, K_SUM, stride_wn, eps, USE_PDL: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    gate_up_silu_tile(x_ptr, nw_ptr, w_ptr, y_ptr, tl.program_id(0), N, K, K_SUM, stride_wn, eps, USE_PDL, BLOCK_N,
                      BLOCK_K)


@triton.jit
def _gemv_residual(x_ptr, w_ptr, r_ptr, y_ptr, N, K: tl.constexpr, stride_wn, USE_PDL: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    gemv_residual_tile(x_ptr, w_ptr, r_ptr, y_ptr, tl.program_id(0), N, K, stride_wn, USE_PDL, BLOCK_N, BLOCK_K)


@triton.jit
def _rotate(ptr, d, half: tl.constexpr, D: tl.constexpr, cos, sin):
    """x·cos + rotate_half(x)·sin (sin signed), rounded as the unfused model rounds it."""
    dt = ptr.dtype.element_ty
    x = tl.load(ptr + d).to(tl.float32)
    xr = tl.load(ptr + (d + half) % D).to(tl.float32)
    return ((x * cos).to(dt).to(tl.float32) + xr * sin).to(dt)


@triton.jit
def _softmax_block(kb, vb, ok, q, m, den, acc, scale):
    """Online softmax over one block of keys kb and values vb [BLOCK_S, D] (rows `ok` valid)."""
    scores = tl.where(ok, tl.sum(kb.to(tl.float32) * q[None, :], axis=1) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new)  # [BLOCK_S]
    acc = acc * alpha + tl.sum(p[:, None] * vb.to(tl.float32), axis=0)
    return m_new, den * alpha + tl.sum(p, axis=0), acc


KEY_RANGES = 8  # most ranges of keys a query head's attention is split in (with counters: see rope_attention)
MIN_RANGE_BLOCKS = tl.constexpr(2)  # blocks of keys a range holds at least (fewer blocks: one range)


@triton.jit
def key_range(pos, r, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """(ranges, first key, end) of range r of `pos` committed keys: blocks of BLOCK_S keys in up to
    SPLITS ranges of at least MIN_RANGE_BLOCKS blocks, in order. They depend on pos only: a decode
    and a row of kernels.few at one position split their keys the same way."""
    blocks = (pos + BLOCK_S - 1) // BLOCK_S
    n = tl.minimum(tl.maximum(blocks // MIN_RANGE_BLOCKS, 1), SPLITS)
    return n, (r * blocks // n) * BLOCK_S, tl.minimum(((r + 1) * blocks // n) * BLOCK_S, pos)


@triton.jit
def hand_over(m, den, acc, part_ptr, c_ptr, group, r, n, d, D: tl.constexpr, SPLITS: tl.constexpr):
    """Range r's partial softmax (m, den, acc [D]) of `group`'s n ranges; the last to arrive combines
    all n in range order (whoever it is) and returns (True, the output [D]); the others (False, acc)."""
    W: tl.constexpr = D + 2
    mine = part_ptr + (group * SPLITS + r) * W
    tl.store(mine + d, acc, cache_modifier=".cg")
    tl.store(mine + D, m, cache_modifier=".cg")
    tl.store(mine + D + 1, den, cache_modifier=".cg")
    tl.debug_barrier()
    last = tl.atomic_add(c_ptr + group, 1, sem="acq_rel", scope="gpu") == n - 1
    out = acc
    if last:
        theirs = part_ptr + group * SPLITS * W
        top = tl.load(theirs + D, cache_modifier=".cg")
        for j in range(1, n):
            top = tl.maximum(top, tl.load(theirs + j * W + D, cache_modifier=".cg"))
        total = tl.zeros([D], dtype=tl.float32)
        norm = top * 0.0
        for j in range(0, n):
            w = tl.exp(tl.load(theirs + j * W + D, cache_modifier=".cg") - top)
            total += tl.load(theirs + j * W + d, cache_modifier=".cg") * w
            norm += tl.load(theirs + j * W + D + 1, cache_modifier=".cg") * w
        out = total / norm
        tl.store(c_ptr + group, 0)
    return last, out


@triton.jit
def _attend(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, out_ptr, part_ptr, c_ptr, stride_slot,
            stride_pos, h, r, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, scale, USE_PDL: tl.constexpr,
            BLOCK_S: tl.constexpr, SPLITS: tl.constexpr):
    kvh = h // (HQ // HKV)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    # Everything but q, k, v of this token was written before this step's graph ran (position, slot,
    # rotary tables, earlier KV entries): read it, the range's first block included, before the wait.
    pos = tl.load(pos_ptr)
    n, lo, hi = key_range(pos, r, SPLITS, BLOCK_S)  # this program's keys [lo, hi) of [0, pos)
    if r < n:
        slot = tl.load(slot_ptr)
        dt = qkv_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + pos * D + d).to(dt).to(tl.float32)  # the tables in the model's dtype
        sin = tl.load(sin_ptr + pos * D + d).to(dt).to(tl.float32)
        k_base = k_ptr + slot * stride_slot + kvh * D
        v_base = v_ptr + slot * stride_slot + kvh * D
        s = lo + tl.arange(0, BLOCK_S)
        ok = s < hi
        kb = tl.load(k_base + s[:, None] * stride_pos + d[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_S, D]
        vb = tl.load(v_base + s[:, None] * stride_pos + d[None, :], mask=ok[:, None], other=0.0)
        # the next block too (masked past hi: no traffic), so its loads overlap the wait; each block of
        # the loop then loads the one after it before its softmax
        nxt = BLOCK_S + s
        k_nxt = tl.load(k_base + nxt[:, None] * stride_pos + d[None, :], mask=(nxt < hi)[:, None], other=0.0)
        v_nxt = tl.load(v_base + nxt[:, None] * stride_pos + d[None, :], mask=(nxt < hi)[:, None], other=0.0)
        _wait(USE_PDL)
        q = _rotate(qkv_ptr + h * D, d, half, D, cos, sin).to(tl.float32)
        if r == 0:  # the first range: the new key from registers, then its blocks
            k_new = _rotate(qkv_ptr + (HQ + kvh) * D, d, half, D, cos, sin)
            v_new = tl.load(qkv_ptr + (HQ + HKV + kvh) * D + d)
            if h % (HQ // HKV) == 0:  # one query head of the group stores the new entry
                tl.store(k_base + pos * stride_pos + d, k_new.to(k_ptr.dtype.element_ty))
                tl.store(v_base + pos * stride_pos + d, v_new.to(v_ptr.dtype.element_ty))
            m = tl.sum(q * k_new.to(tl.float32), axis=0) * scale
            den = m * 0.0 + 1.0
            acc = v_new.to(tl.float32)
        else:
            den = tl.sum(q, axis=0) * 0.0
            m = den - float("inf")
            acc = q * 0.0
        m, den, acc = _softmax_block(kb, vb, ok, q, m, den, acc, scale)
        for s0 in range(lo + BLOCK_S, hi, BLOCK_S):  # (names of their own: s, ok, kb, vb are not loop-carried)
            keys = s0 + tl.arange(0, BLOCK_S)
            k_blk, v_blk = k_nxt, v_nxt
            after = keys + BLOCK_S
            more = (after < hi)[:, None]
            k_nxt = tl.load(k_base + after[:, None] * stride_pos + d[None, :], mask=more, other=0.0)
            v_nxt = tl.load(v_base + after[:, None] * stride_pos + d[None, :], mask=more, other=0.0)
            m, den, acc = _softmax_block(k_blk, v_blk, keys < hi, q, m, den, acc, scale)
        if n == 1:
            last, o = r == 0, acc / den
        else:
            last, o = hand_over(m, den, acc, part_ptr, c_ptr, h, r, n, d, D, SPLITS)
        if last:
            tl.store(out_ptr + h * D + d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _rope_attention(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, out_ptr, part_ptr, c_ptr,
                    stride_slot, stride_pos, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, scale,
                    USE_PDL: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr):
    """One program per (query head, range of keys)."""
    _attend(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, out_ptr, part_ptr, c_ptr, stride_slot,
            stride_pos, tl.program_id(0), tl.program_id(1), HQ, HKV, D, scale, USE_PDL, BLOCK_S, SPLITS)


ATTENTION_BLOCK = (128, 8)  # keys per iteration, warps (the fastest on the H200: bench.fused_variants)


def _launch(pdl: bool) -> dict[str, bool]:
    return {"launch_pdl": True} if pdl else {}


_KERNELS = {"norm_gemv": _norm_gemv, "gate_up_silu": _gate_up_silu, "gemv_residual": _gemv_residual}


@functools.cache
def _gpu(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gemv_blocks(name: str, n: int, k: int, device: torch.device) -> blocks.Blocks:
    """The blocks pinned for this GPU model (kernels.blocks): they fix a GEMV's order of sums."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return blocks.INTERPRETER
    return blocks.lookup(name, n, k, _gpu(device.index or 0))


def _run_gemv(name: str, n: int, k: int, x: torch.Tensor, pdl: bool, *args: Any, **constants: Any) -> None:
    """Launch a GEMV kernel over n output rows with the blocks pinned for this GPU model."""
    block_n, block_k, warps = gemv_blocks(name, n, k, x.device)
    _KERNELS[name][(triton.cdiv(n, block_n),)](*args, USE_PDL=pdl, **constants, BLOCK_N=block_n, BLOCK_K=block_k,
                                           num_warps=warps, num_stages=3, **_launch(pdl))


def norm_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
              pdl: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [K] -> weight [N, K] · rms_norm(x, norm_weight) [N] (no norm when norm_weight is None),
    rounded to x's dtype and stored as out_dtype (default: x's)."""
    n, k = weight.shape
    y = torch.empty(n, device=x.device, dtype=out_dtype or x.dtype)
    nw = x if norm_weight is None else norm_weight
    _run_gemv("norm_gemv", n, k, x, pdl, x, nw, weight, y, n, k, k, weight.stride(0), eps,
              HAS_NORM=norm_weight is not None)
    return y


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 pdl: bool = False) -> torch.Tensor:
    """x [K], weight [2I, K] (gate; up) -> silu(gate·n) * (up·n) [I], n = rms_norm(x)."""
    n2, k = weight.shape
    y = torch.empty(n2 // 2, device=x.device, dtype=x.dtype)
    _run_gemv("gate_up_silu", n2 // 2, k, x, pdl, x, norm_weight, weight, y, n2 // 2, k, k, weight.stride(0), eps)
    return y


def gemv_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [K], weight [N, K], residual [N] -> residual + weight · x [N]."""
    n, k = weight.shape
    y = torch.empty_like(residual)
    _run_gemv("gemv_residual", n, k, x, pdl, x, weight, residual, y, n, k, weight.stride(0))
    return y


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor,
                   slot: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, pdl: bool = False, counters: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [(Hq + 2 Hkv) * D] of one token at `position` (a one-element device tensor) of KV slot
    `slot`; k_cache, v_cache [slots, max_len, Hkv, D] of this layer. Rotates q and k, stores the
    new entry, attends over entries [0, position] -> [Hq * D]. With `counters` (≥ Hq int32 zeros,
    left at zero) a head's committed keys are split in up to KEY_RANGES ranges (key_range), each
    a program, the last to finish combining them; without, one program walks them all."""
    d = k_cache.shape[-1]
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or cos.shape[-1] != d:
        raise ValueError("rope_attention needs a contiguous [slots, max_len, kv_heads, head_dim] cache")
    splits = KEY_RANGES if counters is not None else 1
    if counters is not None and counters.numel() < num_heads:
        raise ValueError(f"rope_attention needs {num_heads} counters, got {counters.numel()}")
    out = torch.empty(num_heads * d, device=qkv.device, dtype=qkv.dtype)
    parts = torch.empty(num_heads * splits * (d + 2) if splits > 1 else 1, device=qkv.device, dtype=torch.float32)
    block, warps = ATTENTION_BLOCK
    _rope_attention[(num_heads, splits)](qkv, cos, sin, position, slot, k_cache, v_cache, out, parts,
                                         counters if counters is not None else parts, k_cache.stride(0),
                                         k_cache.stride(1), HQ=num_heads, HKV=num_kv_heads, D=d, scale=d ** -0.5,
                                         USE_PDL=pdl, BLOCK_S=block, SPLITS=splits, num_warps=warps,
                                         **_launch(pdl))
    return out
