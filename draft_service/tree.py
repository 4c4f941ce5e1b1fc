"""Draft trees (EAGLE-2/3 dynamic trees, greedy), grown for a padded batch with tensors only.

Depth 1 holds the topk most likely tokens after the sequence. Each deeper level expands
the topk best nodes of the level above (by cumulative log-probability): the draft runs
those topk nodes in one forward, and each offers its own topk children, so a level has
topk * topk candidates of which the best topk are expanded in turn. At the end the best
num_draft_tokens - 1 candidates of all levels are kept. A child never scores above its
parent, so the kept set holds every kept node's ancestors.

Expanded nodes write draft KV entries after the committed ones (a level's nodes side by
side); each sees the committed entries, its ancestors' entries and its own. The next
extend overwrites them all.

Candidates are laid out level by level, each expanded node's children in its topk order;
score ties break by index. No host synchronisation: one CUDA graph grows every level. A
chain is the tree of topk 1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
MAX_FUSED_VOCAB = 16384  # kernels.topk.MAX_VOCAB (that module imports Triton)
TOPK_SLICE = 1024  # vocabulary entries a first-stage top-k slice covers, about
log = logging.getLogger("specsplit.draft")


def grow_trees(forward: Forward, to_target_ids: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor,
               hidden: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, topk: int, steps: int, ctx: int,
               fused_top_k: TopK | None = None, fused_level: Callable[..., tuple[torch.Tensor, ...]] | None = None,
               ranks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grow B trees of `steps` levels at once. logits [B, Vd] and hidden [B, H] of each
    sequence after its extend; lengths [B] committed draft entries; slots [B].
    `forward(tokens, hidden, positions, slots, ctx, entries, visible)` is the head on a padded
    batch. Returns, for the N = topk + (steps - 1) * topk² candidates of each tree: target
    ids [B, N], parents [B, N] (candidate index, -1 under the sequence) and the candidates
    best first [B, N] (stable: ties keep index order, so parents come before children).
    `fused_top_k` and `fused_level` (kernels.tree.tree_level with the head's d2t bound) do a
    level's top-k and bookkeeping in one kernel each on CUDA. `ranks` [>= steps, >= K] (a
    benchmark's, specsplit.forced): the candidates scored by these log-probabilities of each
    depth and rank instead of the head's (the same tokens, kept by other scores)."""
    b, k, h = logits.shape[0], topk, hidden.shape[-1]
    lp, ids = top_log_probs(logits, k, fused_top_k)  # [B, K]
    if ranks is not None:
        lp = ranks[0, :k].expand(b, k)
    front_scores = lp.double().clamp(max=0.0)  # cumulative log-probabilities, in float64
    front_tokens = to_target_ids(ids)  # [B, K]
    tokens, scores = [front_tokens], [front_scores]
    parents = [torch.full((b, k), -1, dtype=torch.long, device=logits.device)]
    frontier = torch.arange(k, device=logits.device).expand(b, k)  # candidate index of each frontier node
    inputs = hidden[:, None].expand(b, k, h)  # [B, K, H]
    keys = torch.arange(ctx, device=logits.device)
    seen = (keys[None, :] < lengths[:, None])[:, None].expand(b, k, ctx)  # [B, K, ctx] committed entries
    lane = torch.arange(k, device=logits.device)
    visible: torch.Tensor | None = None  # with fused_level: the next level's view, entries and positions
    for depth in range(1, steps):
        if visible is None:
            entries = lengths[:, None] + (depth - 1) * k + lane  # [B, K] a level's nodes side by side
            positions = (lengths + depth - 1)[:, None].expand(b, k)  # the chain's position for this depth
            visible = seen | (keys == entries[..., None])  # [B, K, ctx]
        out, prenorm = forward(front_tokens, inputs, positions, slots, ctx, entries, visible)  # [B,K,Vd], [B,K,H]
        lp, ids = top_log_probs(out, k, fused_top_k)  # [B, K, K]
        if ranks is not None:
            lp = ranks[depth, :k].expand(b, k, k).contiguous()
        if fused_level is not None:
            cand, cand_tokens, under, front_scores, front_tokens, frontier, inputs, visible, entries, positions = \
                fused_level(lp, ids, front_scores, frontier, lengths, prenorm, visible, k + (depth - 1) * k * k, depth)
            tokens.append(cand_tokens)
            scores.append(cand)
            parents.append(under)
            continue
        cand = (front_scores[..., None] + lp.double().clamp(max=0.0)).reshape(b, k * k)
        cand_tokens = to_target_ids(ids).reshape(b, k * k)
        tokens.append(cand_tokens)
        scores.append(cand)
        parents.append(frontier[..., None].expand(b, k, k).reshape(b, k * k))
        best = torch.sort(cand, dim=-1, descending=True, stable=True).indices[:, :k]  # [B, K]
        frontier = k + (depth - 1) * k * k + best
        front_scores, front_tokens = cand.gather(1, best), cand_tokens.gather(1, best)
        parent_lane = best // k  # each new frontier node's parent, as a lane of this level
        inputs = prenorm.gather(1, parent_lane[..., None].expand(b, k, h))
        seen = visible.gather(1, parent_lane[..., None].expand(b, k, ctx))  # the parent's view, with its entry
        visible = None
    all_scores = torch.cat(scores, dim=1)
    order = torch.sort(all_scores, dim=-1, descending=True, stable=True).indices
    return torch.cat(tokens, dim=1), torch.cat(parents, dim=1), order


def fused_top_k(device: torch.device) -> TopK | None:
    """The one-kernel log-softmax + top-k (specsplit.models.kernels.topk) on a CUDA device, once it
    has run there and matched the unfused result; None elsewhere, without Triton, or where its
    kernel does not compile (with a warning)."""
    if device.type != "cuda":
        return None
    try:
        from specsplit.models.kernels.topk import top_log_probs as fused
    except ImportError:  # torch without Triton
        return None
    try:
        x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(device)
        values, ids = fused(x, 4)
        want = torch.log_softmax(x, -1).topk(4)
        if not torch.equal(ids, want.indices) or not torch.allclose(values, want.values):
            raise RuntimeError("its result differs from log_softmax + topk")
    except Exception as e:  # e.g. Triton without a C compiler
        log.warning("the draft's fused top-k does not run here (%s): it takes the unfused path", e)
        return None
    return fused


def top_log_probs(logits: torch.Tensor, k: int, fused: TopK | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probabilities of each row of logits [..., V] and their indices, largest
    first. With `fused` (fused_top_k's, CUDA) one kernel for vocabularies up to MAX_FUSED_VOCAB
    (ties: the lowest index first); else a log-softmax, then for k = 1 the argmax, for more a
    top-k in two stages (a top-k over a few rows of a whole vocabulary runs one GPU block per row,
    ~30 µs for 8192 entries on the H200): the row cut into slices of about TOPK_SLICE entries,
    each slice's top k, then the top k of those."""
    v = logits.shape[-1]
    if fused is not None and k <= v <= MAX_FUSED_VOCAB:
        return fused(logits, k)
    lp = torch.log_softmax(logits.float(), dim=-1)
    if k == 1:
        best, ids = lp.max(dim=-1, keepdim=True)
        return best, ids
    chunks = _slices(v, k)
    if chunks == 1:
        top = lp.topk(k, dim=-1)
        return top.values, top.indices
    part = lp.unflatten(-1, (chunks, v // chunks)).topk(k, dim=-1)  # [..., C, K]
    offsets = torch.arange(0, v, v // chunks, device=lp.device)[:, None]  # [C, 1]
    values, at = part.values.flatten(-2).topk(k, dim=-1)  # [..., K] of the C·K
    return values, (part.indices + offsets).flatten(-2).gather(-1, at)


def _slices(v: int, k: int) -> int:
    """How many equal slices of about TOPK_SLICE entries a vocabulary of v splits into (1: none)."""
    for c in range(max(2, v // TOPK_SLICE), 4 * v // TOPK_SLICE + 1):
        if v % c == 0 and v // c >= k:
            return c
    return 1


def tree_result(tokens: list[int], parents: list[int], order: list[int], topk: int, steps: int, keep: int
                ) -> tuple[list[int], list[int]]:
    """One row of grow_trees, cut to a tree of `steps` levels (a batch grows its deepest): its
    best `keep` candidates in creation order (parents first) and their parents' indices in that
    list (-1: a child of the sequence)."""
    n = topk + (steps - 1) * topk * topk  # candidates of the first `steps` levels
    kept = sorted(order[:keep] if n >= len(order) else [i for i in order if i < n][:keep])
    index = {node: j for j, node in enumerate(kept)}
    return [tokens[i] for i in kept], [index[parents[i]] if parents[i] >= 0 else -1 for i in kept]


def unpack_trees(packed: torch.Tensor, shapes: dict[int, tuple[int, int, int]], topk: int
                 ) -> dict[int, tuple[list[int], list[int]]]:
    """The rows of `shapes` with this topk, from grow_trees' [B, 3N] (target ids, parents,
    best-first order), each cut to its own steps and size."""
    host = packed.tolist()
    per = packed.shape[1] // 3
    return {i: tree_result(host[i][:per], host[i][per : 2 * per], host[i][2 * per :], topk, shape[1], shape[2])
            for i, shape in shapes.items() if shape[0] == topk}
