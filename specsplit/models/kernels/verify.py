"""Triton kernel of the fused multi-row step's attention (specsplit.models.fused): B sequences of T
tokens each (decodes: T = 1; verifies: a chain or tree). For each sequence: rotary on q and k at
each token's position, the T new k and v written to its slot's entries start..start+T-1, attention
over the committed entries [0, start) and the new ones that its `mask` [T, T] allows (causal for a
chain; ancestors and itself for a tree): one program per (query head, sequence). The step's
projections are in specsplit.models.kernels.projections.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specsplit.models.kernels.decode import _launch, _wait
from specsplit.models.kernels.projections import block_m, precision

MAX_ROWS = 64  # tokens of a fused step, all sequences together (one BLOCK_M tile of the projections)


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
    h, b = tl.program_id(0), tl.program_id(1)  # query head, sequence
    kvh = h // (HQ // HKV)
    qkv_ptr += b * T * stride_qkv  # this sequence's rows
    out_ptr += b * T * HQ * D
    pos_ptr += b * T
    entry_ptr += b * T
    slot_ptr += b
    mask_ptr += b * T * T
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


def tree_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   entries: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, pdl: bool = False) -> torch.Tensor:
    """B sequences of T tokens: qkv [B*T, (Hq + 2 Hkv) * D] at rotary `positions` [B*T], written
    to KV entries `entries` [B, T] (each row consecutive: only its first is read) of `slots` [B];
    mask [B, T, T] (nonzero: token i sees new token j of its sequence); k_cache, v_cache
    [slots, max_len, Hkv, D] of this layer. Every token sees its slot's committed entries
    [0, entries[b, 0]) -> [B*T, Hq * D]."""
    (b, t), d = entries.shape, k_cache.shape[-1]
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or cos.shape[-1] != d or not mask.is_contiguous():
        raise ValueError("tree_attention needs a contiguous [slots, max_len, kv_heads, head_dim] cache and mask")
    if qkv.shape[0] != b * t or mask.shape != (b, t, t) or not entries.is_contiguous():
        raise ValueError(f"tree_attention: {qkv.shape[0]} rows for entries {tuple(entries.shape)} and mask "
                         f"{tuple(mask.shape)}")
    out = torch.empty(b * t, num_heads * d, device=qkv.device, dtype=qkv.dtype)
    block, warps = ATTENTION_BLOCK
    _tree_attention[(num_heads, b)](qkv, qkv.stride(0), cos, sin, positions, entries, slots, mask, k_cache, v_cache,
                                    out, k_cache.stride(0), k_cache.stride(1), t, HQ=num_heads, HKV=num_kv_heads, D=d,
                                    scale=d ** -0.5, BLOCK_S=block, num_warps=warps, USE_PDL=pdl,
                                    DOT=precision(qkv.dtype), BLOCK_M=block_m(t), **_launch(pdl))
    return out
