"""Triton kernel of a verify's greedy acceptance (specsplit.runner.acceptance): after the step's
argmax, one kernel instead of the ~30 small torch kernels of accept + compact + the features'
gather + readback. Program (g, b) handles row b: it computes the row's acceptance (T ≤ 64
nodes: a few hundred integer operations, done again by every program of the row instead of
handed over), and then
  g = 0        the readback [1 + 2T] (accepted count, path, argmax along it) and the
               features along the path [T, X];
  g = 1..2L    with TREE, layer (g - 1) // 2's keys (odd g) or values (even g): the path's KV
               entries moved to start, start+1, ... (all T read, then written).
The path is the accepted nodes in index order, then the others in index order, as
acceptance.accept's stable argsort gives it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rank(best_ptr, fields_ptr, anc_ptr, b, T, stride_fb, stride_ff, stride_ab, stride_ai, CHAIN: tl.constexpr,
          ALWAYS: tl.constexpr, BLOCK_T: tl.constexpr):
    """(node index j [BLOCK_T], its place in the path [BLOCK_T], j < T, accepted nodes, best [BLOCK_T])."""
    j = tl.arange(0, BLOCK_T)
    ok = j < T
    best = tl.load(best_ptr + b * T + j, mask=ok, other=-1)
    parent = tl.load(fields_ptr + b * stride_fb + j, mask=ok, other=-1)
    expect = tl.load(fields_ptr + b * stride_fb + stride_ff + j, mask=ok, other=-1)
    after = tl.load(best_ptr + b * T + tl.maximum(parent, 0), mask=ok, other=-1)
    match = (after == expect) | (parent < 0) | (expect == ALWAYS)  # [BLOCK_T]
    k = tl.arange(0, BLOCK_T)
    if CHAIN:
        anc = k[None, :] <= j[:, None]
    else:
        anc = tl.load(anc_ptr + b * stride_ab + j[:, None] * stride_ai + k[None, :],
                      mask=ok[:, None] & ok[None, :], other=0) != 0
    # accepted: itself and every ancestor match (padding's columns are no ancestors)
    accepted = (tl.min(tl.where(anc & ok[None, :], match[None, :].to(tl.int32), 1), axis=1) != 0) & ok
    a = accepted.to(tl.int32)
    count = tl.sum(a, axis=0)
    place = tl.where(accepted, tl.cumsum(a, axis=0) - 1, count + tl.cumsum(1 - a, axis=0) - 1)
    return j, place, ok, count, best


@triton.jit
def _accept_rows(best_ptr, fields_ptr, anc_ptr, starts_ptr, slots_ptr, k_ptr, v_ptr, feat_ptr, out_feat_ptr,
                 readback_ptr, T, X, stride_fb, stride_ff, stride_ab, stride_ai, stride_st, stride_sl, stride_kl,
                 stride_ks, stride_kp, stride_fr, stride_ft, stride_or, stride_ot, CHAIN: tl.constexpr,
                 ALWAYS: tl.constexpr, TREE: tl.constexpr, FEATURES: tl.constexpr, W: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_W: tl.constexpr):
    g, b = tl.program_id(0), tl.program_id(1)
    j, place, ok, count, best = _rank(best_ptr, fields_ptr, anc_ptr, b, T, stride_fb, stride_ff, stride_ab,
                                      stride_ai, CHAIN, ALWAYS, BLOCK_T)
    if g == 0:
        row = readback_ptr + b * (1 + 2 * T)
        tl.store(row, count.to(readback_ptr.dtype.element_ty))
        tl.store(row + 1 + place, j.to(readback_ptr.dtype.element_ty), mask=ok)
        tl.store(row + 1 + T + place, best.to(readback_ptr.dtype.element_ty), mask=ok)
        if FEATURES:
            for x0 in range(0, X, BLOCK_X):
                x = x0 + tl.arange(0, BLOCK_X)
                at = ok[:, None] & (x < X)[None, :]
                f = tl.load(feat_ptr + b * stride_fr + j[:, None] * stride_ft + x[None, :], mask=at)
                tl.store(out_feat_ptr + b * stride_or + place[:, None] * stride_ot + x[None, :], f, mask=at)
    elif TREE:
        layer = (g - 1) // 2
        kv = k_ptr if g % 2 == 1 else v_ptr
        base = kv + layer * stride_kl + tl.load(slots_ptr + b * stride_sl) * stride_ks
        start = tl.load(starts_ptr + b * stride_st)
        w = tl.arange(0, BLOCK_W)
        at = ok[:, None] & (w < W)[None, :]
        entries = tl.load(base + (start + j)[:, None] * stride_kp + w[None, :], mask=at)  # [BLOCK_T, W]
        tl.debug_barrier()  # every entry read before any is overwritten
        tl.store(base + (start + place)[:, None] * stride_kp + w[None, :], entries, mask=at)


def accept_rows(best: torch.Tensor, fields: torch.Tensor, ancestors: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, features: torch.Tensor | None,
                tree: bool, always: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """best [B, T] (the step's argmax); fields [B, 2, T] (parent, expect); ancestors [B, T, T]
    (ancestors and self; None: chains); k_cache, v_cache [layers, slots, entries, kv_heads,
    head_dim]; slots, starts [B] (strided views allowed); features [B, T, X] or None -> readback [B, 1 + 2T] and the
    features along each row's path, as acceptance.verify_rows gives them. With `tree` the
    path's KV entries move to start, start+1, ...; a node whose expect is `always` is accepted
    whatever the argmax (forced acceptance: acceptance.ALWAYS)."""
    b, t = best.shape
    if t > 64:
        raise ValueError(f"accept_rows: at most 64 nodes a row, got {t}")
    w = k_cache.shape[-2] * k_cache.shape[-1]
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != k_cache.shape[-1] or k_cache.stride() != v_cache.stride():
        raise ValueError("accept_rows needs contiguous [layers, slots, entries, kv_heads, head_dim] caches")
    best = best.contiguous()
    readback = torch.empty(b, 1 + 2 * t, device=best.device, dtype=best.dtype)
    out = torch.empty(features.shape, device=features.device, dtype=features.dtype) if features is not None else None
    feat = features if features is not None else readback
    x = features.shape[-1] if features is not None else 0
    if features is not None and features.stride(-1) != 1:
        raise ValueError("accept_rows needs the features' last dimension contiguous")
    anc = ancestors if ancestors is not None else fields
    if fields.stride(-1) != 1 or anc.stride(-1) != 1:
        raise ValueError("accept_rows needs the fields' and the ancestors' last dimension contiguous")
    groups = 1 + (2 * k_cache.shape[0] if tree else 0)
    feat_strides = (feat.stride(0), feat.stride(1)) if features is not None else (0, 0)
    out_strides = (out.stride(0), out.stride(1)) if out is not None else (0, 0)
    _accept_rows[(groups, b)](
        best, fields, anc, starts, slots, k_cache, v_cache, feat, out if out is not None else readback, readback,
        t, x, fields.stride(0), fields.stride(1), anc.stride(0), anc.stride(1) if ancestors is not None else 0,
        starts.stride(0), slots.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *feat_strides,
        *out_strides, CHAIN=ancestors is None, ALWAYS=always, TREE=tree, FEATURES=features is not None, W=w,
        BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_X=128, BLOCK_W=triton.next_power_of_2(w), num_warps=4)
    return readback, out
