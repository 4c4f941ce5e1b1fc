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

A weight is read once for all T rows: a program multiplies its tile of W [BLOCK_N, BLOCK_K] by the
rows padded to 16 (32, 64) on the tensor cores. A projection as narrow as SmolLM2's (576) has
few tiles of columns, so K is split too (split-K, `plan`): program (tile, s) covers columns
tile·BLOCK_N.. over the K chunk s, writes its fp32 partial product to a workspace and counts
itself in the tile's counter; the tile's last program sums the S partials in the order s = 0..S-1
(whoever arrives last: the result does not depend on timing) and applies the epilogue (RMS norm
scale, SiLU·mul, residual add), then resets the counter. The plan depends on (N, K) and the GPU's
multiprocessor count only, never on timing: a given GPU model computes the same bits in every
process, and rows ≤ 16 the same bits whatever T.

The RMS norm is folded in as in kernels.decode (rstd per row: each program sums the squares of its
chunk, the last adds them up). fp32 models multiply in IEEE fp32 (no TF32), so they agree with the
unfused model to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from specsplit.models.kernels.decode import _launch, _wait

MAX_ROWS = 64  # tokens a fused verify takes (register budget of tree_attention's [rows, head_dim] tiles)
MAX_TILES = 4096  # column tiles of one split projection (the counters of a workspace)


@dataclass(frozen=True)
class Plan:
    """How one projection [N, K] runs: column tiles of block_n, K in `splits` chunks of chunk
    columns (a multiple of block_k)."""
    block_n: int
    block_k: int
    splits: int
    chunk: int
    warps: int = 4

    @property
    def split(self) -> bool:
        return self.splits > 1


def plan(n: int, k: int, sms: int) -> Plan:
    """The rule: 32 columns a tile (64 past 16384), 128 columns of K a step (64 below K = 1024),
    and K split until there are about two programs per multiprocessor."""
    block_n = 32 if n <= 16384 else 64
    block_k = 128 if k >= 1024 else 64
    tiles = triton.cdiv(n, block_n)
    splits = max(1, min(triton.cdiv(k, block_k), triton.cdiv(2 * sms, tiles)))
    chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return Plan(block_n, block_k, triton.cdiv(k, chunk), chunk)


class Workspace:
    """Partial products and per-tile counters of split projections, for the kernels of one stream:
    each kernel leaves its counters at zero, and the next waits for it before it counts."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        # the interpreter (TRITON_INTERPRET=1, on the CPU) plans as for an H200
        self.sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                    if self.device.type == "cuda" else 132)
        self.counters = torch.zeros(MAX_TILES, dtype=torch.int32, device=self.device)
        self._plans: dict[tuple[int, int], Plan] = {}

    def plan(self, n: int, k: int) -> Plan:
        key = (n, k)
        if key not in self._plans:
            self._plans[key] = plan(n, k, self.sms)
        return self._plans[key]

    def partials(self, p: Plan, n: int, per_program: int) -> torch.Tensor:
        """fp32 space for what each program of a split projection hands over (per_program values)."""
        tiles = triton.cdiv(n, p.block_n)
        if p.split and tiles > MAX_TILES:
            raise ValueError(f"a split projection has at most {MAX_TILES} column tiles, got {tiles}")
        return torch.empty(tiles * p.splits * per_program if p.split else 1, dtype=torch.float32, device=self.device)


_WORKSPACES: dict[torch.device, Workspace] = {}


def workspace(device: torch.device) -> Workspace:
    """The default workspace of a device (FusedLlama keeps its own)."""
    if device not in _WORKSPACES:
        _WORKSPACES[device] = Workspace(device)
    return _WORKSPACES[device]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (bf16/fp16 operands ignore it)


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


@triton.jit
def _chunk_dot(x_ptr, nw_ptr, w_rows, n_ok, m, m_ok, k0, k_end, CHUNK, stride_xm, acc, sq, HAS_NORM: tl.constexpr,
               DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += (X·nw)[:, k0:k_end] · W[:, k0:k_end]ᵀ and sq += Σ x² there. The loads stay in the loop,
    so the compiler pipelines them (num_stages tiles in flight)."""
    for i in range(0, CHUNK, BLOCK_K):
        cols = k0 + i + tl.arange(0, BLOCK_K)
        c_ok = cols < k_end
        w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0,
                    eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & c_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        if HAS_NORM:
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
            x = (xf * tl.load(nw_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]).to(w.dtype)
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=DOT)
    return acc, sq


@triton.jit
def _arrive(counter_ptr, SPLITS):
    """Count this program in its tile; True for the tile's last one (its partials all written)."""
    tl.debug_barrier()  # every thread of the program has stored its part
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == SPLITS - 1


@triton.jit
def _gather(p_ptr, at, SPLITS, stride_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Σ over s = 0..SPLITS-1 of the partials [BLOCK_M, BLOCK_N] at p_ptr + s·stride_split + at, in order."""
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(SPLITS):
        total += tl.load(p_ptr + s * stride_split + at, cache_modifier=".cg")
    return total


@triton.jit
def _gather_sq(q_ptr, m, SPLITS, BLOCK_M: tl.constexpr):
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(SPLITS):
        total += tl.load(q_ptr + s * BLOCK_M + m, cache_modifier=".cg")
    return total


@triton.jit
def _norm_mm(x_ptr, nw_ptr, w_ptr, y_ptr, p_ptr, q_ptr, c_ptr, M, N, K, stride_xm, stride_wn, stride_ym, eps,
             CHUNK, SPLITS, HAS_NORM: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr, DOT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile, s = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    k0 = s * CHUNK
    k_end = tl.minimum(K, k0 + CHUNK)
    w_rows = w_ptr + n[:, None] * stride_wn
    _wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, sq = _chunk_dot(x_ptr, nw_ptr, w_rows, n_ok, m, m_ok, k0, k_end, CHUNK, stride_xm, acc, sq, HAS_NORM,
                         DOT,
                         BLOCK_K)
    last = True
    if SPLIT:
        at = m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        part = p_ptr + tile * SPLITS * BLOCK_M * BLOCK_N
        tl.store(part + s * BLOCK_M * BLOCK_N + at, acc, cache_modifier=".cg")
        if HAS_NORM:
            tl.store(q_ptr + (tile * SPLITS + s) * BLOCK_M + m, sq, cache_modifier=".cg")
        last = _arrive(c_ptr + tile, SPLITS)
        if last:
            acc = _gather(part, at, SPLITS, BLOCK_M * BLOCK_N, BLOCK_M, BLOCK_N)
            if HAS_NORM:
                sq = _gather_sq(q_ptr + tile * SPLITS * BLOCK_M, m, SPLITS, BLOCK_M)
            tl.store(c_ptr + tile, 0)
    if last:
        y = acc
        if HAS_NORM:
            y = y * tl.rsqrt(sq / K + eps)[:, None]
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :],
                 y.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_silu_mm(x_ptr, nw_ptr, w_ptr, y_ptr, p_ptr, q_ptr, c_ptr, M, N, K, stride_xm, stride_wn, eps,
                     CHUNK, SPLITS, SPLIT: tl.constexpr, USE_PDL: tl.constexpr, DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w [2N, K]: gate rows, then up rows; a program's gate and up tiles stream in the same pass."""
    tile, s = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    k0 = s * CHUNK
    k_end = tl.minimum(K, k0 + CHUNK)
    g_rows = w_ptr + n[:, None] * stride_wn
    u_rows = w_ptr + (n + N)[:, None] * stride_wn
    _wait(USE_PDL)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK_K):
        cols = k0 + i + tl.arange(0, BLOCK_K)
        c_ok = cols < k_end
        w_ok = n_ok[:, None] & c_ok[None, :]
        wg = tl.load(g_rows + cols[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
        wu = tl.load(u_rows + cols[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        sq += tl.sum(x * x, axis=1)
        xn = (x * tl.load(nw_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]).to(wg.dtype)
        acc_g = tl.dot(xn, tl.trans(wg), acc_g, input_precision=DOT)
        acc_u = tl.dot(xn, tl.trans(wu), acc_u, input_precision=DOT)
    last = True
    if SPLIT:
        at = m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        size: tl.constexpr = BLOCK_M * BLOCK_N
        part = p_ptr + tile * SPLITS * 2 * size
        tl.store(part + (2 * s) * size + at, acc_g, cache_modifier=".cg")
        tl.store(part + (2 * s + 1) * size + at, acc_u, cache_modifier=".cg")
        tl.store(q_ptr + (tile * SPLITS + s) * BLOCK_M + m, sq, cache_modifier=".cg")
        last = _arrive(c_ptr + tile, SPLITS)
        if last:
            acc_g = _gather(part, at, SPLITS, 2 * size, BLOCK_M, BLOCK_N)
            acc_u = _gather(part + size, at, SPLITS, 2 * size, BLOCK_M, BLOCK_N)
            sq = _gather_sq(q_ptr + tile * SPLITS * BLOCK_M, m, SPLITS, BLOCK_M)
            tl.store(c_ptr + tile, 0)
    if last:
        rstd = tl.rsqrt(sq / K + eps)[:, None]
        dt = y_ptr.dtype.element_ty
        g = (acc_g * rstd).to(dt).to(tl.float32)  # the GEMM's rounded outputs
        u = (acc_u * rstd).to(dt).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(y_ptr + m[:, None] * N + n[None, :], (silu * u).to(dt), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _mm_residual(x_ptr, w_ptr, r_ptr, y_ptr, p_ptr, c_ptr, M, N, K, stride_xm, stride_wn, CHUNK, SPLITS,
                 SPLIT: tl.constexpr, USE_PDL: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile, s = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    k0 = s * CHUNK
    k_end = tl.minimum(K, k0 + CHUNK)
    w_rows = w_ptr + n[:, None] * stride_wn
    _wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, sq = _chunk_dot(x_ptr, x_ptr, w_rows, n_ok, m, m_ok, k0, k_end, CHUNK, stride_xm, acc, sq, False, DOT,
                         BLOCK_K)
    last = True
    if SPLIT:
        at = m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        part = p_ptr + tile * SPLITS * BLOCK_M * BLOCK_N
        tl.store(part + s * BLOCK_M * BLOCK_N + at, acc, cache_modifier=".cg")
        last = _arrive(c_ptr + tile, SPLITS)
        if last:
            acc = _gather(part, at, SPLITS, BLOCK_M * BLOCK_N, BLOCK_M, BLOCK_N)
            tl.store(c_ptr + tile, 0)
    if last:
        dt = y_ptr.dtype.element_ty
        at = m[:, None] * N + n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        y = acc.to(dt).to(tl.float32) + tl.load(r_ptr + at, mask=ok, other=0.0).to(tl.float32)
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


def _run(kernel: Any, ws: Workspace, p: Plan, n: int, x: torch.Tensor, pdl: bool, *args: Any,
         **constants: Any) -> None:
    grid = (triton.cdiv(n, p.block_n), p.splits)
    kernel[grid](*args, p.chunk, p.splits, SPLIT=p.split, USE_PDL=pdl, DOT=_precision(x.dtype),
                 BLOCK_M=_block_m(x.shape[0]), BLOCK_N=p.block_n, BLOCK_K=p.block_k, num_warps=p.warps,
                 num_stages=3, **constants, **_launch(pdl))


def norm_mm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, pdl: bool = False,
            out_dtype: torch.dtype | None = None, ws: Workspace | None = None) -> torch.Tensor:
    """x [T, K] -> rms_norm(x, norm_weight) · weightᵀ [T, N] (no norm when norm_weight is None),
    rounded to x's dtype and stored as out_dtype (default: x's)."""
    (m, k), n = x.shape, weight.shape[0]
    ws = ws or workspace(x.device)
    p = ws.plan(n, k)
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    nw = x if norm_weight is None else norm_weight
    bm = _block_m(m)
    parts, sq = ws.partials(p, n, bm * p.block_n), ws.partials(p, n, bm)
    _run(_norm_mm, ws, p, n, x, pdl, x, nw, weight, y, parts, sq, ws.counters, m, n, k, x.stride(0),
         weight.stride(0), y.stride(0), eps, HAS_NORM=norm_weight is not None)
    return y


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 pdl: bool = False, ws: Workspace | None = None) -> torch.Tensor:
    """x [T, K], weight [2I, K] (gate; up) -> silu(n·gateᵀ) * (n·upᵀ) [T, I], n = rms_norm(x)."""
    (m, k), n = x.shape, weight.shape[0] // 2
    ws = ws or workspace(x.device)
    p = ws.plan(n, k)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = _block_m(m)
    parts, sq = ws.partials(p, n, 2 * bm * p.block_n), ws.partials(p, n, bm)
    _run(_gate_up_silu_mm, ws, p, n, x, pdl, x, norm_weight, weight, y, parts, sq, ws.counters, m, n, k,
         x.stride(0), weight.stride(0), eps)
    return y


def mm_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, pdl: bool = False,
                ws: Workspace | None = None) -> torch.Tensor:
    """x [T, K], weight [N, K], residual [T, N] -> residual + x · weightᵀ [T, N]."""
    (m, k), n = x.shape, weight.shape[0]
    ws = ws or workspace(x.device)
    p = ws.plan(n, k)
    y = torch.empty_like(residual)
    parts = ws.partials(p, n, _block_m(m) * p.block_n)
    _run(_mm_residual, ws, p, n, x, pdl, x, weight, residual, y, parts, ws.counters, m, n, k, x.stride(0),
         weight.stride(0))
    return y


def _constants(x: torch.Tensor, pdl: bool) -> dict[str, Any]:
    return {"USE_PDL": pdl, "DOT": _precision(x.dtype), "BLOCK_M": _block_m(x.shape[0]), **_launch(pdl)}


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
