"""Tensor parallelism, visible: a process group handle and three parallel layers.

Weights are loaded whole and each rank keeps its slice. Attention is split by KV-head
groups (unevenly when the group count does not divide, e.g. SmolLM2's 3 KV heads on 2
ranks); with fewer KV heads than ranks, KV heads are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class TensorParallel:
    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-sized shards along the last dimension."""
        if self.world_size == 1:
            return x
        if x.is_cuda:  # one output tensor: capturable in a CUDA graph
            out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)  # [W, ..., shard]
            dist.all_gather_into_tensor(out, x.contiguous())
            return out.movedim(0, -2).reshape(*x.shape[:-1], -1)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items are split as evenly as possible."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def shard_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.world_size:
        kv0, kv1 = split_range(num_kv_heads, tp.world_size, tp.rank)
        return HeadShard(kv0 * group, (kv1 - kv0) * group, kv0, kv1 - kv0)
    if tp.world_size % num_kv_heads or num_heads % tp.world_size:
        raise ValueError(f"cannot shard {num_heads} heads / {num_kv_heads} KV heads over {tp.world_size} ranks")
    q_count = num_heads // tp.world_size
    return HeadShard(tp.rank * q_count, q_count, tp.rank * num_kv_heads // tp.world_size, 1)


class MergedColumnParallelLinear(nn.Linear):
    """Several column-parallel projections of one input in one GEMM (q|k|v, gate|up):
    each rank stores its row slice of every part, stacked; `split` separates the outputs."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]], bias: bool = False) -> None:
        super().__init__(in_features, sum(end - start for start, end in parts), bias=bias)
        self.parts = parts  # [(out_start, out_end)] of each part, in full-weight rows
        self.sizes = [end - start for start, end in parts]

    def load_parts(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> None:
        self.weight.data.copy_(torch.cat([w[s:e] for w, (s, e) in zip(weights, self.parts, strict=True)]))
        if self.bias is not None:
            if biases is None or any(b is None for b in biases):
                raise KeyError("a biased merged projection needs the bias of every part")
            self.bias.data.copy_(torch.cat([b[s:e] for b, (s, e) in zip(biases, self.parts, strict=True)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W[:, cols].T) : each rank owns a slice of the inputs."""

    def __init__(self, in_start: int, in_end: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(in_end - in_start, out_features, bias=False)
        self.in_start, self.in_end, self.tp = in_start, in_end, tp

    def load_full(self, weight: torch.Tensor) -> None:
        self.weight.data.copy_(weight[:, self.in_start : self.in_end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class ParallelLMHead(nn.Module):
    """Vocabulary-sharded output projection; logits are gathered on every rank."""

    def __init__(self, hidden: int, vocab: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.shard = -(-vocab // tp.world_size)  # padded so all_gather gets equal parts
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden))

    def load_full(self, weight: torch.Tensor) -> None:
        part = weight[self.start : self.start + self.shard]
        self.weight.data.zero_()
        self.weight.data[: part.shape[0]].copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(F.linear(x, self.weight))  # [tokens, padded vocab]
        return logits[..., : self.vocab]
