"""Greedy acceptance on the device, inside the verify step (its graph, where the step has one).

A verified row is the last emitted token (the root, node 0) followed by the drafts, a chain or
a tree. The host knows the drafts and the device the target's argmax, so the host packs, per
node j:
- parent[j]: the node before it (-1 for the root);
- expect[j]: the token the target's argmax after parent[j] must be for j to be accepted;
  -1 (never) for padding, for rows not accepted on the device (sampled), and for a node
  repeating an earlier sibling's token (walking down, the first such sibling is taken);
  ALWAYS for the nodes that forced acceptance (a benchmark mode, specsplit.forced) takes
  whatever the target's argmax: `forced` deep (or to a leaf) down the path that goes deepest,
  the first such child at each node;
and the step's mask says each node's ancestors. A node is accepted when it and each of its
ancestors but the root match: the accepted nodes are one path down from the root. The device
orders each row's nodes as that path first, then the rest in index order, moves the path's
KV entries to the committed entries start, start+1, ... and its captured features to the
first rows, and hands the host one small integer tensor per step (see `readback`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specsplit.models.layers import KVCache

ALWAYS = -2  # expect: accepted whatever the target's argmax (forced acceptance)


def row_fields(tokens: list[int], parents: Sequence[int] | None, accept: bool, t: int, forced: int = -1
               ) -> tuple[list[int], list[int]]:
    """A row of len(tokens) <= t nodes (parents: node indices, -1 for the root; None: a chain)
    -> parent, expect [t] (see the module's docstring); padding continues the chain. forced
    >= 0: that many nodes down the deepest path are accepted, whatever the argmax."""
    n = len(tokens)
    parent = [*(parents if parents else range(-1, n - 1)), *range(n - 1, t - 1)]
    expect = [-1] * t
    if accept and forced >= 0:
        height = [0] * n  # of each node's subtree (nodes come after their parents)
        for j in range(n - 1, 0, -1):
            height[parent[j]] = max(height[parent[j]], height[j] + 1)
        node = 0
        for _ in range(min(forced, height[0])):
            node = max((j for j in range(node + 1, n) if parent[j] == node), key=lambda j: (height[j], -j))
            expect[node] = ALWAYS
    elif accept and parents:
        if len(set(zip(parent[1:n], tokens[1:], strict=True))) == n - 1:  # no twins (a draft's top-k siblings differ)
            expect[1:n] = tokens[1:]
        else:
            seen: set[tuple[int, int]] = set()
            for j in range(1, n):
                key = (parent[j], tokens[j])
                if key not in seen:
                    seen.add(key)
                    expect[j] = tokens[j]
    elif accept:  # a chain: each node has a parent of its own, so no sibling repeats its token
        expect[1:n] = tokens[1:]
    return parent, expect


def accept(best: torch.Tensor, expect: torch.Tensor, parent: torch.Tensor, ancestors: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """best, expect, parent [B, T]; ancestors [B, T, T] (ancestors and self; None: chains) ->
    path [B, T] (the accepted nodes in order, then the others), accepted nodes a row [B]
    (the root counts). No host synchronisation."""
    t = best.shape[1]
    idx = torch.arange(t, device=best.device)
    if ancestors is None:
        ancestors = idx[None, :] <= idx[:, None]  # [T, T] causal
    match = (best.gather(1, parent.clamp(min=0)) == expect) | (parent < 0) | (expect == ALWAYS)  # [B, T]
    accepted = (~ancestors.bool() | match[:, None, :]).all(-1)  # [B, T]: itself and every ancestor match
    path = torch.where(accepted, idx, idx + t).argsort(-1)  # [B, T]
    return path, accepted.sum(-1)


def compact(cache: KVCache, slots: torch.Tensor, starts: torch.Tensor, path: torch.Tensor) -> None:
    """Move each row's KV entries start + path[d] to start + d, in every layer (trees: a chain's
    path is already in place). slots, starts [B]; path [B, T]."""
    rows = slots[:, None]  # [B, 1]
    src = starts[:, None] + path  # [B, T]
    dst = starts[:, None] + torch.arange(path.shape[1], device=path.device)
    for kv in (cache.k, cache.v):  # [layers, slots, entries, kv_heads, head_dim]
        kv[:, rows, dst] = kv[:, rows, src]


def verify_rows(logits: torch.Tensor, features: torch.Tensor | None, fields: torch.Tensor,
                ancestors: torch.Tensor | None, cache: KVCache, slots: torch.Tensor, starts: torch.Tensor,
                tree: bool, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step's acceptance: logits [B, T, V]; features [B, T, X] or None; fields [B, 2, T]
    (parent, expect) -> readback [B, 1 + 2T] and the features along each row's path. With
    `tree`, the KV entries move too. `fused` (CUDA, Triton): after the argmax, one kernel
    (kernels.accept) instead of the torch operations below, with the same results."""
    best = logits.argmax(-1)  # [B, T]
    if fused and best.shape[1] > 1:
        from specsplit.models.kernels.accept import accept_rows  # Triton: on the GPU machine only

        return accept_rows(best, fields, ancestors, cache.k, cache.v, slots, starts, features, tree, ALWAYS)
    if best.shape[1] == 1:  # one token a row: nothing drafted
        path = torch.zeros_like(best)
        count = torch.ones_like(best[:, 0])
    else:
        path, count = accept(best, fields[:, 1], fields[:, 0], ancestors)
        if tree:
            compact(cache, slots, starts, path)
        if features is not None:
            features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
    return readback(count, path, best.gather(1, path)), features


def readback(count: torch.Tensor, path: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """[B, 1 + 2T]: accepted nodes (the root counts), the path, the argmax after each node along it."""
    return torch.cat([count[:, None], path, best], 1)
