"""Building blocks shared by the target model and the EAGLE-3 head."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from specsplit.models.batch import Batch
from specsplit.models.parallel import (
    HeadShard,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    split_range,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # computed in float32, one kernel on CUDA


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind == "llama3":  # Llama 3.1 long-context frequency scaling
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv


class Rotary(nn.Module):
    """Precomputed cos/sin tables; `rotate_half` (Hugging Face) layout. The sin table carries
    rotate_half's sign (-sin on the first half), so a rotation is a roll, a mul and an addcmul."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), rope_inv_freq(head_dim, theta, scaling))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)  # [max_pos, head_dim]
        sin = freqs.sin()
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1).float(), persistent=False)  # signed

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos, signed sin [tokens, 1, head_dim] for these positions: looked up once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


RopeTables = tuple[torch.Tensor, torch.Tensor]


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by its positions' angles: x*cos + rotate_half(x)*sin,
    where rotate_half(x) = [-x2, x1] = roll(x, half) * [-1, 1] and the sign sits in the table
    (bitwise the same as negating x2: the sign flip is exact)."""
    cos, signed_sin = rope
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class KVCache:
    """Preallocated per-sequence KV slots: [layers, slots, max_len, kv_heads, head_dim]."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (layers, slots, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def write_and_read(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [tokens, kv_heads, head_dim] at [start, start+tokens); return [0, end)."""
        end = start + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the KV cache length {self.max_len}")
        self.k[layer, slot, start:end] = k
        self.v[layer, slot, start:end] = v
        return self.k[layer, slot, :end], self.v[layer, slot, :end]

    def write_rows(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, T, kv_heads, head_dim] at entries [0, T) of each of the slots [B]."""
        if k.shape[1] > self.max_len:
            raise ValueError(f"sequence of {k.shape[1]} tokens exceeds the KV cache length {self.max_len}")
        self.k[layer, slots, : k.shape[1]] = k
        self.v[layer, slots, : k.shape[1]] = v

    def write_and_gather(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, kv_heads, head_dim] at a padded batch's entries; return keys and
        values [B, ctx, kv_heads, head_dim]. No host synchronisation: capturable."""
        assert batch.slots is not None and batch.entries is not None
        rows = batch.slots[:, None]  # [B, 1] broadcast against entries [B, T]
        self.k[layer].index_put_((rows, batch.entries), k)
        self.v[layer].index_put_((rows, batch.entries), v)
        return self.k[layer, batch.slots, : batch.ctx], self.v[layer, batch.slots, : batch.ctx]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] at entries start..start+T-1 against k, v [S, Hkv, D], S = start+T: causal
    (each token sees the entries up to its own: the attention kernels' lower-right causal path, no
    mask; from entry 0 the same as prompt_attention), or as `visible` [T, S] says."""
    t, s = q.shape[0], k.shape[0]
    mask = causal_lower_right(t, s) if visible is None else visible.to(q.device)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, enable_gqa=True)[0]  # [Hq, T, D]
    return out.transpose(0, 1).reshape(t, -1)


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, D] against k, v [B, T, Hkv, D] of the same tokens, from entry 0, causal ->
    [B*T, Hq*D]. No mask: the attention kernels' causal path (flash where the device has it)."""
    b, t, hq, d = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)  # [B, Hq, T, D]
    return out.transpose(1, 2).reshape(b * t, hq * d)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
    """q [B, T, Hq, D] against k, v [B, ctx, Hkv, D] -> [B*T, Hq*D]. Grouped-query attention
    without copying keys per query head: the G query heads of a KV head become G*T query rows
    against that head's keys (q head h reads KV head h // G, as in Hugging Face's layout)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    rows = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)  # [B, Hkv, G*T, D]
    out = F.scaled_dot_product_attention(rows, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=batch.grouped_mask(g, q.dtype))  # [B, Hkv, G*T, D]
    return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hq * d)


class Attention(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 shard: HeadShard, tp: TensorParallel, bias: bool = False, qk_norm_eps: float | None = None
                 ) -> None:
        super().__init__()
        d = head_dim
        self.head_dim, self.shard = d, shard
        q_rows = (shard.q_start * d, (shard.q_start + shard.q_count) * d)
        kv_rows = (shard.kv_start * d, (shard.kv_start + shard.kv_count) * d)
        self.qkv_proj = MergedColumnParallelLinear(in_features, [q_rows, kv_rows, kv_rows], bias)
        self.o_proj = RowParallelLinear(*q_rows, hidden, tp)
        self.q_norm = RMSNorm(d, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(d, qk_norm_eps) if qk_norm_eps is not None else None

    def project(self, x: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, in] -> q [N, Hq, D] and k [N, Hkv, D] (normed where the model does, rotated), v [N, Hkv, D]."""
        n, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [N, (Hq + 2 Hkv) * D]
        hq = self.shard.q_count
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = (y.reshape(n, -1, d) for y in self.qkv_proj.split(qkv))
            return apply_rope(self.q_norm(q), rope), apply_rope(self.k_norm(k), rope), v
        qk = apply_rope(qkv[:, : (hq + self.shard.kv_count) * d].view(n, -1, d), rope)  # [N, Hq + Hkv, D], one pass
        return qk[:, :hq], qk[:, hq:], qkv[:, (hq + self.shard.kv_count) * d :].view(n, -1, d)

    def forward(self, x: torch.Tensor, rope: RopeTables, cache: KVCache, layer: int, batch: Batch) -> torch.Tensor:
        """x [N, in]: the tokens of every sequence, flattened. Projections run once for the
        whole batch; attention runs per segment against its own KV slot, or for a padded or
        prompts batch in one call."""
        d = self.head_dim
        q, k, v = self.project(x, rope)
        if batch.prompts:
            assert batch.slots is not None
            b, t = batch.slots.shape[0], batch.ctx
            q, k, v = q.view(b, t, -1, d), k.view(b, t, -1, d), v.view(b, t, -1, d)
            cache.write_rows(layer, batch.slots, k, v)
            return self.o_proj(prompt_attention(q, k, v))
        if batch.segments is None:
            assert batch.entries is not None
            b, t = batch.entries.shape
            k_all, v_all = cache.write_and_gather(layer, batch, k.view(b, t, -1, d), v.view(b, t, -1, d))
            return self.o_proj(padded_attention(q.view(b, t, -1, d), k_all, v_all, batch))
        outs, off = [], 0
        for seg in batch.segments:
            part = slice(off, off + seg.length)
            k_all, v_all = cache.write_and_read(layer, seg.slot, seg.start, k[part], v[part])
            outs.append(causal_attention(q[part], k_all, v_all, seg.start, seg.visible))
            off += seg.length
        return self.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])

    def load(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        names = ("q_proj", "k_proj", "v_proj")
        self.qkv_proj.load_parts([weights[f"{prefix}.{n}.weight"] for n in names],
                                 [weights.get(f"{prefix}.{n}.bias") for n in names])
        self.o_proj.load_full(weights[f"{prefix}.o_proj.weight"])
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.weight.data.copy_(weights[f"{prefix}.q_norm.weight"])
            self.k_norm.weight.data.copy_(weights[f"{prefix}.k_norm.weight"])


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel) -> None:
        super().__init__()
        i0, i1 = split_range(intermediate, tp.world_size, tp.rank)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [(i0, i1), (i0, i1)])
        self.down_proj = RowParallelLinear(i0, i1, hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)

    def load(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.gate_up_proj.load_parts([weights[f"{prefix}.gate_proj.weight"], weights[f"{prefix}.up_proj.weight"]])
        self.down_proj.load_full(weights[f"{prefix}.down_proj.weight"])
