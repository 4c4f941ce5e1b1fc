"""Triton kernel of the fused multi-row step's attention (specsplit.models.fused): B sequences of T
tokens each (decodes: T = 1; verifies: a chain or tree). For each sequence: rotary on q and k at
each token's position, the T new k and v written to its slot's entries start..start+T-1, attention
over the committed entries [0, start) and the new ones that its `mask` [T, T] allows (causal for a
chain; ancestors and itself for a tree): a few programs per (kv head's query group, sequence),
each over a range of the committed entries (flash-decoding), the group's query heads and the
sequence's tokens together as the rows of one tensor-core tile while they fit 16 rows. The
step's projections are in specsplit.models.kernels.projections.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specsplit.models.kernels.decode import _launch, _wait
from specsplit.models.kernels.projections import precision

SEQ_ROWS = 64  # tokens of one sequence in a fused step (one tile of the attention's rows)
MAX_ROWS = 256  # tokens of a fused step, all sequences together (the projections' row tiles side by side)


@triton.jit
def _rotate_rows(ptr, at, ok, d, half: tl.constexpr, D: tl.constexpr, cos, sin):
    """Vectors [M, D] at ptr + at[m] (rows with `ok`; zeros elsewhere): x·cos + rotate_half(x)·sin
    (sin signed), rounded as the unfused model."""
    dt = ptr.dtype.element_ty
    x = tl.load(ptr + at[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    xr = tl.load(ptr + at[:, None] + ((d + half) % D)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
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
                    out_ptr, part_ptr, c_ptr, stride_slot, stride_pos, T, vis_ptr, stride_vb, stride_vt,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, scale, SPLITS: tl.constexpr,
                    USE_PDL: tl.constexpr, DOT: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, VISIBLE: tl.constexpr):
    g, b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # HEADS query heads, sequence, key range
    kvh = g * HEADS // (HQ // HKV)
    qkv_ptr += b * T * stride_qkv  # this sequence's rows
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    r = tl.arange(0, BLOCK_M)  # the tile's rows: (token, query head), a token's HEADS heads side by side
    tok = r // HEADS
    h = g * HEADS + r % HEADS  # [BLOCK_M] each row's query head
    r_ok = tok < T
    t = tl.arange(0, BLOCK_T)  # the new tokens, as keys
    t_ok = t < T
    # inputs written before the graph ran (positions, entries, slot, mask, rotary tables, the
    # committed keys and values): read before waiting for the previous kernel
    pos = tl.load(pos_ptr + b * T + tok, mask=r_ok, other=0)  # [BLOCK_M] rotary positions
    start = tl.load(entry_ptr + b * T)  # the tokens' KV entries are start..start+T-1
    slot = tl.load(slot_ptr + b)
    dt = qkv_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos[:, None] * D + d[None, :]).to(dt).to(tl.float32)  # [BLOCK_M, D]
    sin = tl.load(sin_ptr + pos[:, None] * D + d[None, :]).to(dt).to(tl.float32)
    k_base = k_ptr + slot * stride_slot + kvh * D
    v_base = v_ptr + slot * stride_slot + kvh * D
    # this program's committed keys: [lo, hi), whole blocks, the SPLITS ranges in order
    per = tl.cdiv(tl.cdiv(start, SPLITS), BLOCK_S) * BLOCK_S
    lo = split * per
    hi = tl.minimum(start, lo + per)
    keys = lo + tl.arange(0, BLOCK_S)
    ok = keys < hi
    kb = tl.load(k_base + keys[:, None] * stride_pos + d[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_S, D]
    vb = tl.load(v_base + keys[:, None] * stride_pos + d[None, :], mask=ok[:, None], other=0.0)
    vis_rows = vis_ptr + b * stride_vb + tok * stride_vt  # VISIBLE: each row's token's row of visible [B, T, ctx]
    _wait(USE_PDL)
    q = _rotate_rows(qkv_ptr, tok * stride_qkv + h * D, r_ok, d, half, D, cos, sin)  # [BLOCK_M, D]
    if split == 0:  # the new keys, from registers as the mask allows
        if VISIBLE:
            seen = tl.load(vis_rows[:, None] + (start + t)[None, :], mask=r_ok[:, None] & t_ok[None, :],
                           other=0) != 0
        else:
            seen = tl.load(mask_ptr + b * T * T + tok[:, None] * T + t[None, :], mask=r_ok[:, None] & t_ok[None, :],
                           other=0) != 0
        seen = seen | (tl.minimum(tok, T - 1)[:, None] == t[None, :])  # a token sees itself; padding rows the last
        pos_t = tl.load(pos_ptr + b * T + t, mask=t_ok, other=0)  # [BLOCK_T]
        cos_t = tl.load(cos_ptr + pos_t[:, None] * D + d[None, :]).to(dt).to(tl.float32)  # [BLOCK_T, D]
        sin_t = tl.load(sin_ptr + pos_t[:, None] * D + d[None, :]).to(dt).to(tl.float32)
        k_new = _rotate_rows(qkv_ptr, t * stride_qkv + (HQ + kvh) * D, t_ok, d, half, D, cos_t, sin_t)  # [BLOCK_T, D]
        v_new = tl.load(qkv_ptr + t[:, None] * stride_qkv + (HQ + HKV + kvh) * D + d[None, :], mask=t_ok[:, None],
                        other=0.0)
        if (g * HEADS) % (HQ // HKV) == 0:  # the first program of the kv head's group stores the new entries
            at = (start + t)[:, None] * stride_pos + d[None, :]
            tl.store(k_base + at, k_new.to(k_ptr.dtype.element_ty), mask=t_ok[:, None])
            tl.store(v_base + at, v_new.to(v_ptr.dtype.element_ty), mask=t_ok[:, None])
        scores = tl.where(seen, tl.dot(q, tl.trans(k_new), input_precision=DOT) * scale, float("-inf"))
        m_i = tl.max(scores, axis=1)
        p = tl.exp(scores - m_i[:, None])
        den = tl.sum(p, axis=1)
        acc = tl.dot(p.to(v_new.dtype), v_new, input_precision=DOT)  # [BLOCK_M, D] fp32
    else:  # finite: a range without keys leaves exp(m - max) = 0, never NaN
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        den = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    allowed = ok[None, :]
    if VISIBLE:
        allowed = allowed & (tl.load(vis_rows[:, None] + keys[None, :], mask=r_ok[:, None] & ok[None, :], other=0) != 0)
    scores = tl.where(allowed, tl.dot(q, tl.trans(kb), input_precision=DOT) * scale, float("-inf"))
    m_i, den, acc = _softmax_rows(scores, vb, m_i, den, acc, DOT)
    for s0 in range(lo + BLOCK_S, hi, BLOCK_S):
        blk_keys = s0 + tl.arange(0, BLOCK_S)
        valid = blk_keys < hi
        k_blk = tl.load(k_base + blk_keys[:, None] * stride_pos + d[None, :], mask=valid[:, None], other=0.0)
        v_blk = tl.load(v_base + blk_keys[:, None] * stride_pos + d[None, :], mask=valid[:, None], other=0.0)
        allowed = valid[None, :]
        if VISIBLE:
            allowed = allowed & (tl.load(vis_rows[:, None] + blk_keys[None, :], mask=r_ok[:, None] & valid[None, :],
                                         other=0) != 0)
        blk = tl.where(allowed, tl.dot(q, tl.trans(k_blk), input_precision=DOT) * scale, float("-inf"))
        m_i, den, acc = _softmax_rows(blk, v_blk, m_i, den, acc, DOT)
    out_at = out_ptr + (b * T + tok)[:, None] * (HQ * D) + h[:, None] * D + d[None, :]
    if SPLITS == 1:
        tl.store(out_at, (acc / den[:, None]).to(out_ptr.dtype.element_ty), mask=r_ok[:, None])
    else:  # hand over (m, den, acc); the last of the SPLITS programs combines them in range order
        group = b * (HQ // HEADS) + g
        W: tl.constexpr = D + 2
        mine = part_ptr + (group * SPLITS + split) * BLOCK_M * W + r * W
        tl.store(mine[:, None] + d[None, :], acc, cache_modifier=".cg")
        tl.store(mine + D, m_i, cache_modifier=".cg")
        tl.store(mine + D + 1, den, cache_modifier=".cg")
        tl.debug_barrier()
        if tl.atomic_add(c_ptr + group, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            theirs = part_ptr + group * SPLITS * BLOCK_M * W + r * W
            top = tl.full([BLOCK_M], -1.0e30, tl.float32)
            for s in tl.static_range(SPLITS):
                top = tl.maximum(top, tl.load(theirs + s * BLOCK_M * W + D, cache_modifier=".cg"))
            total = tl.zeros([BLOCK_M, D], dtype=tl.float32)
            norm = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                at = theirs + s * BLOCK_M * W
                w = tl.exp(tl.load(at + D, cache_modifier=".cg") - top)
                total += tl.load(at[:, None] + d[None, :], cache_modifier=".cg") * w[:, None]
                norm += tl.load(at + D + 1, cache_modifier=".cg") * w
            tl.store(out_at, (total / norm[:, None]).to(out_ptr.dtype.element_ty), mask=r_ok[:, None])
            tl.store(c_ptr + group, 0)


ATTENTION_BLOCK = (64, 4, 4)  # committed keys per iteration, warps, most key ranges a program's rows


GROUP_ROWS = 16  # the most (token, head) rows a program takes a kv head's group in: the smallest tile


def query_heads(tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """Query heads a program serves: a kv head's whole group while its tokens × heads fit the
    smallest tile (the group's keys and values read once, the tile no larger), else one (a
    larger tile lengthens each program more than fewer programs save: measured with
    bench.verify_step on the H100)."""
    group = num_heads // num_kv_heads
    return group if tokens * group <= GROUP_ROWS else 1


def key_ranges(batch: int, programs: int, sms: int) -> int:
    """Key ranges of each of a sequence's `programs`: ATTENTION_BLOCK's while the grid stays within
    five programs per multiprocessor, else one (a batch of many sequences fills the GPU by itself;
    measured with bench.verify_step on the H200)."""
    ranges = ATTENTION_BLOCK[2]
    return ranges if batch * programs * ranges <= 5 * sms else 1


def tree_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   entries: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, counters: torch.Tensor,
                   sms: int, pdl: bool = False, visible: torch.Tensor | None = None) -> torch.Tensor:
    """B sequences of T tokens: qkv [B*T, (Hq + 2 Hkv) * D] at rotary `positions` [B*T], written
    to KV entries `entries` [B, T] (each row consecutive: only its first is read) of `slots` [B];
    mask [B, T, T] (nonzero: token i sees new token j of its sequence); k_cache, v_cache
    [slots, max_len, Hkv, D] of this layer; counters: ≥ B·Hq int32 zeros (left at zero); sms: the
    GPU's multiprocessors. Every token sees its slot's committed entries [0, entries[b, 0])
    -> [B*T, Hq * D]. With `visible` [B, T, ≥ entries + T] (bool or integers; instead of mask)
    each token sees the entries its row names, committed and new (a draft's tree level: the
    committed entries, its ancestors' and its own).

    A program takes a sequence's tokens for `query_heads` heads of one kv head's group, its rows
    (token, head) pairs on the tensor cores, so the group's keys and values are read once. Its
    committed entries are split in `key_ranges` ranges, each a program; the last program of the
    rows to finish combines their partial softmaxes in range order (the result does not depend on
    which finished last)."""
    (b, t), d = entries.shape, k_cache.shape[-1]
    if visible is not None:
        if visible.dtype == torch.bool:
            visible = visible.view(torch.uint8)
        if visible.shape[:2] != (b, t) or visible.stride(-1) != 1:
            raise ValueError(f"tree_attention: visible {tuple(visible.shape)} for entries {tuple(entries.shape)}")
        mask = visible  # unread
    elif mask is None:
        raise ValueError("tree_attention needs a mask or visible")
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or cos.shape[-1] != d or not mask.is_contiguous():
        raise ValueError("tree_attention needs a contiguous [slots, max_len, kv_heads, head_dim] cache and mask")
    if not (entries.is_contiguous() and positions.is_contiguous() and slots.is_contiguous()):
        raise ValueError("tree_attention reads entries, positions and slots as contiguous tensors")
    if t > SEQ_ROWS:
        raise ValueError(f"tree_attention takes at most {SEQ_ROWS} tokens a sequence, got {t}")
    if qkv.shape[0] != b * t or (visible is None and mask.shape != (b, t, t)):
        raise ValueError(f"tree_attention: {qkv.shape[0]} rows for entries {tuple(entries.shape)} and mask "
                         f"{tuple(mask.shape)}")
    block, warps, _ = ATTENTION_BLOCK
    heads = query_heads(t, num_heads, num_kv_heads)
    programs = num_heads // heads  # a sequence's, for each range of keys
    splits = key_ranges(b, programs, sms)
    if splits > 1 and counters.numel() < b * programs:
        raise ValueError(f"tree_attention needs {b * programs} counters, got {counters.numel()}")
    out = torch.empty(b * t, num_heads * d, device=qkv.device, dtype=qkv.dtype)
    bm = max(16, triton.next_power_of_2(t * heads))  # a program's (token, head) rows, one tile
    parts = torch.empty(b * programs * splits * bm * (d + 2) if splits > 1 else 1, device=qkv.device,
                        dtype=torch.float32)
    _tree_attention[(programs, b, splits)](
        qkv, qkv.stride(0), cos, sin, positions, entries, slots, mask, k_cache, v_cache, out, parts, counters,
        k_cache.stride(0), k_cache.stride(1), t, mask if visible is None else visible,
        0 if visible is None else visible.stride(0), 0 if visible is None else visible.stride(1), HQ=num_heads,
        HKV=num_kv_heads, D=d, scale=d ** -0.5, SPLITS=splits, BLOCK_S=block, num_warps=warps, USE_PDL=pdl,
        DOT=precision(qkv.dtype), HEADS=heads, BLOCK_M=bm, BLOCK_T=max(16, triton.next_power_of_2(t)),
        VISIBLE=visible is not None, **_launch(pdl))
    return out
