"""Triton kernels of the fused multi-row step's projections (specsplit.models.fused: the rows of a
verify's chain or tree, or of a batch of sequences):

  embed_prenorm  H = E[tokens], and H·nw with the partial Σ h² of each row for the first layer's norm
  prenorm        H·nw and the partial Σ h² of rows already in hand (tensor parallelism: after the all-reduce)
  norm_mm        Y = rms_norm(X) · Wᵀ          q|k|v, and the final norm + lm_head
  gate_up_silu   A = silu(rms_norm(X)·Gᵀ) * (rms_norm(X)·Uᵀ)
  mm_residual    H' = H + A · Wᵀ               the o and down projections with the residual add; it also
                                               leaves H'·nw and the partial Σ h'² for the next norm

The rows go in tiles of 16 (ROW_TILE), side by side on a grid axis: a program multiplies its tile
of W [BLOCK_N, BLOCK_K] by its 16 rows (padding rows zeros) on the tensor cores, its first tile
loaded before the wait for the previous kernel (with PDL), the rest pipelined by the compiler; a
step of more than 16 rows reads each weight tile once a row tile (the later reads from L2), and a
row computes the same bits in a step of any size. A projection as
narrow as SmolLM2's (576) has few tiles of columns, so K may be split too (split-K): program
(tile, s, row tile) covers columns tile·BLOCK_N.. over the K chunk s, writes its fp32 partial
product to a workspace and counts itself in its (row tile, column tile)'s counter; the last
program sums the S partials in the order s = 0..S-1 (whoever arrives last: the result does not
depend on timing), applies the epilogue and resets the counter. K may also be split inside a
program (Plan.ksplit = KS): a K step is KS tiles [BLOCK_K] multiplied as one batched product
[KS, BLOCK_M, BLOCK_N] (each warp on its own tiles, not one warp's accumulator chain over all of
K) and summed over KS. SmolLM2's projections take 2.7-4.7 µs a launch of 16 rows this way on the
H100 and 2.2-3.8 on the H200 (bench.tune_mm). A program's chunk of K is a compile-time constant:
a chunk of one K step compiles without a loop (nor the loop's pipeline buffers). The plan (tile,
K step, chunk, warps, KS) is pinned per GPU model and matrix in kernels.blocks
(`mm_plans.json`), never chosen by timing: a given GPU model computes the same bits in every
process.

The RMS norm is split around the GEMM: rms_norm(x)·w = rstd · Σ W[n,k] (x[k]·nw[k]). The kernel
that writes x (the residual add before, or embed_prenorm) also writes x·nw rounded to the
activations' dtype (`Normed.scaled`, the GEMM's operand) and Σ x² over its tile of columns; the
projection adds those up for rstd. The GEMM's loop then only streams operands, as a plain GEMM does
(folding the norm into the loop costs 2.8x at 8B's q|k|v). fp32 models multiply in IEEE fp32 (no
TF32), so they agree with the unfused model to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from specsplit.models.kernels import blocks
from specsplit.models.kernels.blocks import Plan
from specsplit.models.kernels.decode import _launch, _wait
from specsplit.models.kernels.mm_steps import _arrive, _chunk_dot, _gather, _rstd, _step_dot, _w_step, _x_step

MAX_TILES = 4096  # (row tile, column tile) pairs of one split projection (the counters of a workspace)
ROW_TILE = 16  # rows a program: a step's rows padded to a multiple, the tiles side by side


class Workspace:
    """Partial products and per-tile counters of split projections, for the kernels of one stream:
    each kernel leaves its counters at zero, and the next waits for it before it counts."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        # the interpreter (TRITON_INTERPRET=1, on the CPU) plans as for an H200
        self.sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                    if self.device.type == "cuda" else 132)
        self.counters = torch.zeros(MAX_TILES, dtype=torch.int32, device=self.device)
        self.gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "interpreter"
        self._plans: dict[tuple[str, int, int, int, bool], Plan] = {}

    def plan(self, kernel: str, n: int, k: int, rows: int, dtype: torch.dtype) -> Plan:
        """The pinned plan of a projection [N, K] for `rows` rows (kernels.blocks)."""
        key = (kernel, n, k, dtype.itemsize <= 2)
        if key not in self._plans:
            self._plans[key] = blocks.mm_lookup(kernel, n, k, ROW_TILE, self.gpu, self.sms, key[3])
        return self._plans[key]

    def partials(self, p: Plan, n: int, rows: int, per_program: int) -> torch.Tensor:
        """fp32 space for what each program of a split projection of `rows` rows hands over
        (per_program values)."""
        tiles = triton.cdiv(n, p.block_n) * row_tiles(rows)
        if p.split and tiles > MAX_TILES:
            raise ValueError(f"a split projection has at most {MAX_TILES} tiles, got {tiles}")
        return torch.empty(tiles * p.splits * per_program if p.split else 1, dtype=torch.float32, device=self.device)


_WORKSPACES: dict[torch.device, Workspace] = {}


def workspace(device: torch.device) -> Workspace:
    """The default workspace of a device (FusedLlama keeps its own)."""
    if device not in _WORKSPACES:
        _WORKSPACES[device] = Workspace(device)
    return _WORKSPACES[device]


def precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (bf16/fp16 operands ignore it)


def row_tiles(rows: int) -> int:
    return triton.cdiv(rows, ROW_TILE)


def padded_rows(rows: int) -> int:
    """Rows of a step's tiles together: the row stride of a Normed's squares."""
    return row_tiles(rows) * ROW_TILE


@triton.jit
def _put_normed(y, m, m_ok, n, n_ok, tile, N, nw_ptr, xn_ptr, q_ptr, Q_STRIDE):
    """For the next RMS norm: y·nw rounded to the activations' dtype, and this tile's Σ y² per row
    (squares [tiles, Q_STRIDE]: padding rows' zeros too)."""
    nw = tl.load(nw_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(xn_ptr + m[:, None] * N + n[None, :], (y * nw[None, :]).to(xn_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
    tl.store(q_ptr + tile * Q_STRIDE + m, tl.sum(tl.where(n_ok[None, :], y * y, 0.0), axis=1), mask=m < Q_STRIDE)


@triton.jit
def _prenorm(tok_ptr, e_ptr, h_ptr, nw_ptr, xn_ptr, q_ptr, Q_STRIDE, M, N, stride_e, GATHER: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """H·nw with its partial Σ h² for the next norm, of rows H = E (GATHER: H = E[tokens], stored)."""
    tile = tl.program_id(0)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's row tile
    m_ok = m < M
    ok = m_ok[:, None] & n_ok[None, :]
    row = tl.load(tok_ptr + m, mask=m_ok, other=0).to(tl.int64) if GATHER else m.to(tl.int64)
    x = tl.load(e_ptr + row[:, None] * stride_e + n[None, :], mask=ok, other=0.0)
    if GATHER:
        tl.store(h_ptr + m[:, None] * N + n[None, :], x, mask=ok)
    _put_normed(x.to(tl.float32), m, m_ok, n, n_ok, tile, N, nw_ptr, xn_ptr, q_ptr, Q_STRIDE)


@triton.jit
def _norm_mm(x_ptr, q_ptr, Q_TILES, Q_STRIDE, w_ptr, y_ptr, p_ptr, c_ptr, M, N, K, stride_xm, stride_wn, stride_ym, eps,
             CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr, DOT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KS: tl.constexpr,
             TILES_P2: tl.constexpr):
    """Y = rstd · (X·nw) · Wᵀ, with X·nw and the partial Σ x² as _put_normed leaves them."""
    tile, s, rt = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # column tile, K chunk, row tile
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = rt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    counter = rt * tl.num_programs(0) + tile  # this (row tile, column tile)'s counter and partials
    k0 = s * CHUNK
    k_end = tl.minimum(K, k0 + CHUNK)
    w_rows = w_ptr + n[:, None] * stride_wn
    w = _w_step(w_rows, n_ok, k0, k_end, KS, BLOCK_K)
    _wait(USE_PDL)
    if not SPLIT:  # every program finishes its tile: the norm's loads go out with the operands'
        rstd = _rstd(q_ptr, Q_TILES, Q_STRIDE, m, K, eps, TILES_P2)
    acc = _chunk_dot(x_ptr, w, w_rows, n_ok, m, m_ok, k0, k_end, CHUNK, stride_xm, DOT, BLOCK_M, BLOCK_N, BLOCK_K,
                     KS)
    last = True
    if SPLIT:
        at = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        part = p_ptr + counter * SPLITS * BLOCK_M * BLOCK_N
        tl.store(part + s * BLOCK_M * BLOCK_N + at, acc, cache_modifier=".cg")
        last = _arrive(c_ptr + counter, SPLITS)
        if last:
            acc = _gather(part, at, SPLITS, BLOCK_M * BLOCK_N, BLOCK_M, BLOCK_N)
            tl.store(c_ptr + counter, 0)
        rstd = _rstd(q_ptr, Q_TILES, Q_STRIDE, m, K, eps, TILES_P2)
    if last:
        y = acc * rstd[:, None]
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :],
                 y.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_silu_mm(x_ptr, q_ptr, Q_TILES, Q_STRIDE, w_ptr, y_ptr, p_ptr, c_ptr, M, N, K, stride_xm, stride_wn, eps,
                     CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
                     DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     KS: tl.constexpr, TILES_P2: tl.constexpr):
    """w [2N, K]: gate rows, then up rows; a program's gate and up tiles stream in the same pass."""
    tile, s, rt = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # column tile, K chunk, row tile
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = rt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    counter = rt * tl.num_programs(0) + tile  # this (row tile, column tile)'s counter and partials
    k0 = s * CHUNK
    k_end = tl.minimum(K, k0 + CHUNK)
    g_rows = w_ptr + n[:, None] * stride_wn
    u_rows = w_ptr + (n + N)[:, None] * stride_wn
    wg = _w_step(g_rows, n_ok, k0, k_end, KS, BLOCK_K)  # before the wait, as _chunk_dot
    wu = _w_step(u_rows, n_ok, k0, k_end, KS, BLOCK_K)
    _wait(USE_PDL)
    if not SPLIT:
        rstd = _rstd(q_ptr, Q_TILES, Q_STRIDE, m, K, eps, TILES_P2)
    x = _x_step(x_ptr, m, m_ok, k0, k_end, stride_xm, KS, BLOCK_K)
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_g = _step_dot(x, wg, zero, DOT, KS)
    acc_u = _step_dot(x, wu, zero, DOT, KS)
    for i in range(BLOCK_K * KS, CHUNK, BLOCK_K * KS):
        x = _x_step(x_ptr, m, m_ok, k0 + i, k_end, stride_xm, KS, BLOCK_K)
        acc_g = _step_dot(x, _w_step(g_rows, n_ok, k0 + i, k_end, KS, BLOCK_K), acc_g, DOT, KS)
        acc_u = _step_dot(x, _w_step(u_rows, n_ok, k0 + i, k_end, KS, BLOCK_K), acc_u, DOT, KS)
    last = True
    if SPLIT:
        at = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        size: tl.constexpr = BLOCK_M * BLOCK_N
        part = p_ptr + counter * SPLITS * 2 * size
        tl.store(part + (2 * s) * size + at, acc_g, cache_modifier=".cg")
        tl.store(part + (2 * s + 1) * size + at, acc_u, cache_modifier=".cg")
        last = _arrive(c_ptr + counter, SPLITS)
        if last:
            acc_g = _gather(part, at, SPLITS, 2 * size, BLOCK_M, BLOCK_N)
            acc_u = _gather(part + size, at, SPLITS, 2 * size, BLOCK_M, BLOCK_N)
            tl.store(c_ptr + counter, 0)
        rstd = _rstd(q_ptr, Q_TILES, Q_STRIDE, m, K, eps, TILES_P2)
    if last:
        dt = y_ptr.dtype.element_ty
        g = (acc_g * rstd[:, None]).to(dt).to(tl.float32)  # the GEMM's rounded outputs
        u = (acc_u * rstd[:, None]).to(dt).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(y_ptr + m[:, None] * N + n[None, :], (silu * u).to(dt), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _mm_residual(x_ptr, w_ptr, r_ptr, y_ptr, p_ptr, c_ptr, nw_ptr, xn_ptr, q_ptr, Q_STRIDE, M, N, K, stride_xm,
                 stride_wn, CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLIT: tl.constexpr, NEXT_NORM: tl.constexpr,
                 USE_PDL: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, KS: tl.constexpr):
    """H' = H + X · Wᵀ; with NEXT_NORM also H'·nw and its partial Σ h'² for the next projection."""
    tile, s, rt = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # column tile, K chunk, row tile
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = rt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    counter = rt * tl.num_programs(0) + tile  # this (row tile, column tile)'s counter and partials
    k0 = s * CHUNK
    k_end = tl.minimum(K, k0 + CHUNK)
    w_rows = w_ptr + n[:, None] * stride_wn
    w = _w_step(w_rows, n_ok, k0, k_end, KS, BLOCK_K)
    _wait(USE_PDL)
    at = m[:, None] * N + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if not SPLIT:  # the residual's load goes out with the operands'
        res = tl.load(r_ptr + at, mask=ok, other=0.0)
    acc = _chunk_dot(x_ptr, w, w_rows, n_ok, m, m_ok, k0, k_end, CHUNK, stride_xm, DOT, BLOCK_M, BLOCK_N, BLOCK_K,
                     KS)
    last = True
    if SPLIT:
        at_p = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        part = p_ptr + counter * SPLITS * BLOCK_M * BLOCK_N
        tl.store(part + s * BLOCK_M * BLOCK_N + at_p, acc, cache_modifier=".cg")
        last = _arrive(c_ptr + counter, SPLITS)
        if last:
            acc = _gather(part, at_p, SPLITS, BLOCK_M * BLOCK_N, BLOCK_M, BLOCK_N)
            tl.store(c_ptr + counter, 0)
        res = tl.load(r_ptr + at, mask=ok, other=0.0)
    if last:
        dt = y_ptr.dtype.element_ty
        y = (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)
        tl.store(y_ptr + at, y, mask=ok)
        if NEXT_NORM:
            _put_normed(y.to(tl.float32), m, m_ok, n, n_ok, tile, N, nw_ptr, xn_ptr, q_ptr, Q_STRIDE)


def _run(kernel: Any, p: Plan, n: int, x: torch.Tensor, pdl: bool, *args: Any, **constants: Any) -> None:
    grid = (triton.cdiv(n, p.block_n), p.splits, row_tiles(x.shape[0]))
    kernel[grid](*args, p.chunk, p.splits, SPLIT=p.split, USE_PDL=pdl, DOT=precision(x.dtype),
                 BLOCK_M=ROW_TILE, BLOCK_N=p.block_n, BLOCK_K=p.block_k, KS=p.ksplit, num_warps=p.warps,
                 num_stages=3, **constants, **_launch(pdl))


@dataclass
class Normed:
    """Rows on their way into an RMS-normed projection: x·nw rounded to the activations' dtype
    [T, K], and each row's Σ x² in partial sums over column tiles [tiles, padded_rows(T)] (fp32),
    added up by the projection."""
    scaled: torch.Tensor
    squares: torch.Tensor
    tiles: int

    @property
    def stride(self) -> int:
        """The squares' row stride."""
        return self.squares.numel() // self.tiles


PRENORM_BLOCK = 64  # columns a program of embed_prenorm


def _normed(h: torch.Tensor) -> Normed:
    tiles = triton.cdiv(h.shape[1], PRENORM_BLOCK)
    return Normed(torch.empty_like(h), torch.empty(tiles * padded_rows(h.shape[0]), dtype=torch.float32,
                                                   device=h.device), tiles)


def embed_prenorm(tokens: torch.Tensor, embedding: torch.Tensor, norm_weight: torch.Tensor
                  ) -> tuple[torch.Tensor, Normed]:
    """tokens [T], embedding [V, K] -> (h = embedding[tokens] [T, K], the Normed of h for a
    projection after rms_norm(·, norm_weight): the first layer's input)."""
    (m,), k = tokens.shape, embedding.shape[1]
    h = torch.empty(m, k, device=embedding.device, dtype=embedding.dtype)
    out = _normed(h)
    _prenorm[(out.tiles, row_tiles(m))](tokens, embedding, h, norm_weight, out.scaled, out.squares, out.stride, m,
                                        k, embedding.stride(0), GATHER=True, BLOCK_M=ROW_TILE, BLOCK_N=PRENORM_BLOCK)
    return h, out


def prenorm(h: torch.Tensor, norm_weight: torch.Tensor) -> Normed:
    """h [T, K] -> its Normed for a projection after rms_norm(h, norm_weight): under tensor
    parallelism, the all-reduced sum that mm_residual could not norm on its own shard."""
    m, k = h.shape
    out = _normed(h)
    _prenorm[(out.tiles, row_tiles(m))](h, h, h, norm_weight, out.scaled, out.squares, out.stride, m, k,
                                        h.stride(0), GATHER=False, BLOCK_M=ROW_TILE, BLOCK_N=PRENORM_BLOCK)
    return out


def norm_mm(x: Normed, weight: torch.Tensor, eps: float, pdl: bool = False, out_dtype: torch.dtype | None = None,
            ws: Workspace | None = None) -> torch.Tensor:
    """rms_norm(x) · weightᵀ [T, N] for x from embed_prenorm or mm_residual(next_norm=...), weight
    [N, K], rounded to the activations' dtype and stored as out_dtype (default: theirs)."""
    xs = x.scaled
    (m, k), n = xs.shape, weight.shape[0]
    ws = ws or workspace(xs.device)
    p = ws.plan("norm_mm", n, k, m, xs.dtype)
    y = torch.empty(m, n, device=xs.device, dtype=out_dtype or xs.dtype)
    parts = ws.partials(p, n, m, ROW_TILE * p.block_n)
    _run(_norm_mm, p, n, xs, pdl, xs, x.squares, x.tiles, x.stride, weight, y, parts, ws.counters, m, n, k,
         xs.stride(0), weight.stride(0), y.stride(0), eps, TILES_P2=triton.next_power_of_2(x.tiles))
    return y


def gate_up_silu(x: Normed, weight: torch.Tensor, eps: float, pdl: bool = False,
                 ws: Workspace | None = None) -> torch.Tensor:
    """silu(n·gateᵀ) * (n·upᵀ) [T, I] for n = rms_norm(x), x a Normed [T, K], weight [2I, K] (gate; up)."""
    xs = x.scaled
    (m, k), n = xs.shape, weight.shape[0] // 2
    ws = ws or workspace(xs.device)
    p = ws.plan("gate_up_silu_mm", n, k, m, xs.dtype)
    y = torch.empty(m, n, device=xs.device, dtype=xs.dtype)
    parts = ws.partials(p, n, m, 2 * ROW_TILE * p.block_n)
    _run(_gate_up_silu_mm, p, n, xs, pdl, xs, x.squares, x.tiles, x.stride, weight, y, parts, ws.counters, m, n, k,
         xs.stride(0), weight.stride(0), eps, TILES_P2=triton.next_power_of_2(x.tiles))
    return y


def mm_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, pdl: bool = False,
                ws: Workspace | None = None, next_norm: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Normed | None]:
    """x [T, K], weight [N, K], residual [T, N] -> (h = residual + x · weightᵀ [T, N], and with
    next_norm [N] the Normed of h for the projection after rms_norm(h, next_norm))."""
    (m, k), n = x.shape, weight.shape[0]
    ws = ws or workspace(x.device)
    p = ws.plan("mm_residual", n, k, m, x.dtype)
    y = torch.empty_like(residual)
    normed = None
    if next_norm is not None:
        tiles = triton.cdiv(n, p.block_n)
        normed = Normed(torch.empty_like(residual), torch.empty(tiles * padded_rows(m), dtype=torch.float32,
                                                                device=x.device), tiles)
    parts = ws.partials(p, n, m, ROW_TILE * p.block_n)
    nw, xn, q = (next_norm, normed.scaled, normed.squares) if normed is not None else (y, y, parts)
    _run(_mm_residual, p, n, x, pdl, x, weight, residual, y, parts, ws.counters, nw, xn, q, padded_rows(m), m, n, k,
         x.stride(0), weight.stride(0), NEXT_NORM=normed is not None)
    return y, normed
