"""Triton helpers of the multi-row projections (specsplit.models.kernels.projections): a program's
operand tiles, its steps over K (one tile [BLOCK_N, BLOCK_K], or KS tiles side by side
[KS, BLOCK_N, BLOCK_K] multiplied as one batched product, each warp on its own, and summed over
KS: K split inside the program), the hand-over of split-K partials between a tile's programs,
and the RMS norm's 1/rms from the partial sums of squares."""

import triton
import triton.language as tl


@triton.jit
def _w_tile(w_rows, n_ok, cols, k_end):
    return tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & (cols < k_end)[None, :], other=0.0,
                   eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]


@triton.jit
def _x_tile(x_ptr, m, m_ok, cols, k_end, stride_xm):
    return tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & (cols < k_end)[None, :],
                   other=0.0)  # [BLOCK_M, BLOCK_K]


@triton.jit
def _k_cols(k0, KS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The columns of a K step of KS tiles from k0: [KS, 1, BLOCK_K]."""
    return k0 + tl.arange(0, KS)[:, None, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, None, :]


@triton.jit
def _w_step(w_rows, n_ok, k0, k_end, KS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights of one K step from k0: [BLOCK_N, BLOCK_K], or [KS, BLOCK_N, BLOCK_K] split inside
    the program (KS > 1)."""
    if KS == 1:
        w = _w_tile(w_rows, n_ok, k0 + tl.arange(0, BLOCK_K), k_end)
    else:
        cols = _k_cols(k0, KS, BLOCK_K)
        w = tl.load(w_rows[None, :, :] + cols, mask=n_ok[None, :, None] & (cols < k_end), other=0.0,
                    eviction_policy="evict_first")
    return w


@triton.jit
def _x_step(x_ptr, m, m_ok, k0, k_end, stride_xm, KS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The rows' operands of one K step from k0: [BLOCK_M, BLOCK_K], or [KS, BLOCK_M, BLOCK_K]."""
    if KS == 1:
        x = _x_tile(x_ptr, m, m_ok, k0 + tl.arange(0, BLOCK_K), k_end, stride_xm)
    else:
        cols = _k_cols(k0, KS, BLOCK_K)
        x = tl.load(x_ptr + m[None, :, None] * stride_xm + cols, mask=m_ok[None, :, None] & (cols < k_end),
                    other=0.0)
    return x


@triton.jit
def _step_dot(x, w, acc, DOT: tl.constexpr, KS: tl.constexpr):
    """acc + x · wᵀ of one K step; split inside the program, each tile's product [KS, BLOCK_M, BLOCK_N]
    (the warps each on their own tiles) summed over the tiles."""
    if KS == 1:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT)
    else:
        acc = acc + tl.sum(tl.dot(x, tl.permute(w, (0, 2, 1)), input_precision=DOT), axis=0)
    return acc


@triton.jit
def _chunk_dot(x_ptr, w, w_rows, n_ok, m, m_ok, k0, k_end, CHUNK: tl.constexpr, stride_xm, DOT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KS: tl.constexpr):
    """X[:, k0:k_end] · W[:, k0:k_end]ᵀ [BLOCK_M, BLOCK_N] fp32, w the first K step's weights (loaded
    before the kernel's wait: they depend on nothing computed); the compiler pipelines the loads
    of the rest (num_stages steps in flight)."""
    acc = _step_dot(_x_step(x_ptr, m, m_ok, k0, k_end, stride_xm, KS, BLOCK_K), w,
                    tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT, KS)
    for i in range(BLOCK_K * KS, CHUNK, BLOCK_K * KS):
        acc = _step_dot(_x_step(x_ptr, m, m_ok, k0 + i, k_end, stride_xm, KS, BLOCK_K),
                        _w_step(w_rows, n_ok, k0 + i, k_end, KS, BLOCK_K), acc, DOT, KS)
    return acc


@triton.jit
def _arrive(counter_ptr, SPLITS: tl.constexpr):
    """Count this program in its tile; True for the tile's last one (its partials all written)."""
    tl.debug_barrier()  # every thread of the program has stored its part
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == SPLITS - 1


@triton.jit
def _gather(p_ptr, at, SPLITS: tl.constexpr, stride_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Σ over s = 0..SPLITS-1 of the partials [BLOCK_M, BLOCK_N] at p_ptr + s·stride_split + at, in
    order (unrolled: the loads go out together)."""
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(p_ptr + s * stride_split + at, cache_modifier=".cg")
    return total


@triton.jit
def _rstd(q_ptr, TILES, Q_STRIDE, m, K, eps, TILES_P2: tl.constexpr):
    """1 / rms of rows m from their partial Σ x² [TILES, Q_STRIDE], in one load."""
    t = tl.arange(0, TILES_P2)
    sq = tl.load(q_ptr + t[:, None] * Q_STRIDE + m[None, :], mask=(t < TILES)[:, None], other=0.0)
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
