"""Building blocks shared by the target model and the EAGLE-3 head."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.models.parallel import (
    ColumnParallelLinear,
    HeadShard,
    RowParallelLinear,
    TensorParallel,
    split_range,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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
    """Precomputed cos/sin tables; `rotate_half` (Hugging Face) layout."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), rope_inv_freq(head_dim, theta, scaling))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens inside a flattened batch: `length` tokens of KV slot
    `slot` at positions start..start+length-1."""

    slot: int
    start: int
    length: int


def segment_positions(segments: list[Segment], device: torch.device | str) -> torch.Tensor:
    return torch.cat([torch.arange(s.start, s.start + s.length, device=device) for s in segments])  # [N]


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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [T, Hq, D] at positions start..start+T-1 against k, v [S, Hkv, D], S = start+T."""
    t, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)  # [Hq, T, D]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    allowed = torch.arange(s, device=q.device)[None, :] <= (start + torch.arange(t, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed)  # [Hq, T, D]
    return out.transpose(0, 1).reshape(t, -1)


class Attention(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 shard: HeadShard, tp: TensorParallel, bias: bool = False, qk_norm_eps: float | None = None
                 ) -> None:
        super().__init__()
        d = head_dim
        self.head_dim, self.shard = d, shard
        self.q_proj = ColumnParallelLinear(in_features, shard.q_start * d, (shard.q_start + shard.q_count) * d, bias)
        kv = (shard.kv_start * d, (shard.kv_start + shard.kv_count) * d)
        self.k_proj = ColumnParallelLinear(in_features, *kv, bias=bias)
        self.v_proj = ColumnParallelLinear(in_features, *kv, bias=bias)
        self.o_proj = RowParallelLinear(shard.q_start * d, (shard.q_start + shard.q_count) * d, hidden, tp)
        self.q_norm = RMSNorm(d, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(d, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, cache: KVCache,
                layer: int, segments: list[Segment]) -> torch.Tensor:
        """x [N, in]: the tokens of every segment, flattened. Projections run once for the
        whole batch; attention runs per segment against its own KV slot."""
        n, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(n, -1, d)
        k = self.k_proj(x).view(n, -1, d)
        v = self.v_proj(x).view(n, -1, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, positions), rotary(k, positions)
        outs, off = [], 0
        for seg in segments:
            part = slice(off, off + seg.length)
            k_all, v_all = cache.write_and_read(layer, seg.slot, seg.start, k[part], v[part])
            outs.append(causal_attention(q[part], k_all, v_all, seg.start))
            off += seg.length
        return self.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel) -> None:
        super().__init__()
        i0, i1 = split_range(intermediate, tp.world_size, tp.rank)
        self.gate_proj = ColumnParallelLinear(hidden, i0, i1)
        self.up_proj = ColumnParallelLinear(hidden, i0, i1)
        self.down_proj = RowParallelLinear(i0, i1, hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def load_linear(module: nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    """Load a (possibly parallel) linear layer from full, unsharded weights."""
    weight = weights[f"{prefix}.weight"]
    bias = weights.get(f"{prefix}.bias")
    if isinstance(module, ColumnParallelLinear):
        module.load_full(weight, bias)
    elif isinstance(module, RowParallelLinear):
        module.load_full(weight)
    else:
        raise TypeError(f"{prefix}: not a parallel linear layer")
