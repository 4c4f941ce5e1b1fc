"""Tensor parallelism, visible: a process group handle and three parallel layers.

Weights are loaded whole and each rank keeps its slice. Attention is split by KV-head
groups (unevenly when the group count does not divide, e.g. SmolLM2's 3 KV heads on 2
ranks); with fewer KV heads than ranks, each KV group's query heads are split over ranks of
its own, which replicate its KV head (`shard_heads`).

On the CPU in fp32, `pack_for_cpu` also keeps each layer's weight in oneDNN's blocked layout,
packed once (the runner does it): a product of a few rows (a verify's) then streams the weight
about as a one-row product does, where MKL's small-M GEMM repacks it on every call, and a row
computes the same bits whatever the number of rows.
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
    """This rank's query heads and the KV heads they read, each a contiguous range in which every
    KV head serves the same number of query heads. Up to as many ranks as KV heads, each rank
    takes whole KV groups (unevenly where they do not divide). Past that, each KV group goes to
    ranks of its own (as evenly as possible), which split its query heads and each hold a copy
    of its KV head: SmolLM2's 9 heads / 3 KV heads run on 4 ranks as 2 + 1 + 3 + 3 query heads,
    on 8 as 1 + 1 + 1 + 1 + 1 + 1 + 2 + 1."""
    group, world = num_heads // num_kv_heads, tp.world_size
    if num_kv_heads >= world:
        kv0, kv1 = split_range(num_kv_heads, world, tp.rank)
        return HeadShard(kv0 * group, (kv1 - kv0) * group, kv0, kv1 - kv0)
    kv = next(j for j in range(num_kv_heads) if tp.rank < split_range(world, num_kv_heads, j)[1])
    r0, r1 = split_range(world, num_kv_heads, kv)  # the ranks of this KV group
    if r1 - r0 > group:
        raise ValueError(f"cannot shard {num_heads} heads / {num_kv_heads} KV heads over {world} ranks: "
                         f"{r1 - r0} ranks would share a KV group of {group} query heads")
    q0, q1 = split_range(group, r1 - r0, tp.rank - r0)
    return HeadShard(kv * group + q0, q1 - q0, kv, 1)


PACK_ROWS = 8  # the rows oneDNN's layout is chosen for (any count runs)


def _linear(x: torch.Tensor, layer: nn.Linear | ParallelLMHead, bias: torch.Tensor | None = None) -> torch.Tensor:
    packed = layer.packed
    if packed is not None and x.device.type == "cpu" and x.dtype == packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, layer.weight, bias)


def pack_for_cpu(model: nn.Module, pack: bool = True) -> int:
    """Pack the weight of every parallel layer of an fp32 model on the CPU (see above), or with
    `pack` False drop the packed copies (torch.compile traces the plain product); how many.
    Weights loaded afterwards drop their packed copy."""
    layers = [m for m in model.modules() if isinstance(m, MergedColumnParallelLinear | RowParallelLinear
                                                                | ParallelLMHead)]
    usable = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    if not pack or not usable or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32
                                     for m in layers):
        for m in layers:
            m.packed = None
        return 0
    with torch.no_grad():
        for m in layers:
            m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_ROWS)
    return len(layers)


class MergedColumnParallelLinear(nn.Linear):
    """Several column-parallel projections of one input in one GEMM (q|k|v, gate|up):
    each rank stores its row slice of every part, stacked; `split` separates the outputs."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]], bias: bool = False) -> None:
        super().__init__(in_features, sum(end - start for start, end in parts), bias=bias)
        self.packed: torch.Tensor | None = None  # pack_for_cpu
        self.parts = parts  # [(out_start, out_end)] of each part, in full-weight rows
        self.sizes = [end - start for start, end in parts]

    def load_parts(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> None:
        self.packed = None
        self.weight.data.copy_(torch.cat([w[s:e] for w, (s, e) in zip(weights, self.parts, strict=True)]))
        if self.bias is not None:
            if biases is None or any(b is None for b in biases):
                raise KeyError("a biased merged projection needs the bias of every part")
            self.bias.data.copy_(torch.cat([b[s:e] for b, (s, e) in zip(biases, self.parts, strict=True)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W[:, cols].T) : each rank owns a slice of the inputs."""

    def __init__(self, in_start: int, in_end: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(in_end - in_start, out_features, bias=False)
        self.packed: torch.Tensor | None = None  # pack_for_cpu
        self.in_start, self.in_end, self.tp = in_start, in_end, tp

    def load_full(self, weight: torch.Tensor) -> None:
        self.packed = None
        self.weight.data.copy_(weight[:, self.in_start : self.in_end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(_linear(x, self))


class ParallelLMHead(nn.Module):
    """Vocabulary-sharded output projection; logits are gathered on every rank."""

    def __init__(self, hidden: int, vocab: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.shard = -(-vocab // tp.world_size)  # padded so all_gather gets equal parts
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden))
        self.packed: torch.Tensor | None = None  # pack_for_cpu

    def load_full(self, weight: torch.Tensor) -> None:
        part = weight[self.start : self.start + self.shard]
        self.packed = None
        self.weight.data.zero_()
        self.weight.data[: part.shape[0]].copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(_linear(x, self))  # [tokens, padded vocab]
        return logits[..., : self.vocab]
