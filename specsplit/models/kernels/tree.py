"""Triton kernel of a draft tree's level bookkeeping (draft_service.tree.grow_trees): after the
head has run a level's K frontier nodes and their top-K children are known, one program per
sequence

  - scores the K·K candidates (the parent's cumulative log-probability + the child's, in
    float64), maps their draft ids to target ids and records their parents;
  - ranks them (descending, ties by index: a stable sort) and takes the best K as the next
    frontier, with their scores and tokens;
  - gathers each new frontier node's inputs (its parent's pre-norm state) and builds its view of
    the KV entries (its parent's, plus its own next entry), its entry and rotary position.

The views change only over the tree's own entries, after the committed ones: the kernel
rewrites that window in place, so its cost does not grow with the views' width (the draft
keeps it fixed: one graph serves every context length).

Unfused this is ~20 small kernels a level.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_level(lp_ptr, ids_ptr, d2t_ptr, front_ptr, frontier_ptr, len_ptr, prenorm_ptr, vis_ptr,
                scores_ptr, tokens_ptr, parents_ptr, next_front_ptr, next_tokens_ptr, next_frontier_ptr,
                inputs_ptr, entries_ptr, positions_ptr, base, depth, H, CTX,
                K: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    n: tl.constexpr = K * K
    i = tl.arange(0, NP)  # candidates
    ok = i < n
    lp = tl.load(lp_ptr + b * n + i, mask=ok, other=0.0).to(tl.float64)
    parent = i // K  # the frontier lane each candidate hangs under
    front = tl.load(front_ptr + b * K + parent, mask=ok, other=0.0)
    cand = front + tl.minimum(lp, 0.0)  # [NP] float64
    draft_ids = tl.load(ids_ptr + b * n + i, mask=ok, other=0)
    tokens = draft_ids + tl.load(d2t_ptr + draft_ids, mask=ok, other=0)
    tl.store(scores_ptr + b * n + i, cand, mask=ok)
    tl.store(tokens_ptr + b * n + i, tokens, mask=ok)
    tl.store(parents_ptr + b * n + i, tl.load(frontier_ptr + b * K + parent, mask=ok, other=0), mask=ok)
    # rank: how many candidates come before (higher, or equal with a lower index)
    cv = tl.where(ok, cand, float("-inf"))
    before = (cv[None, :] > cv[:, None]) | ((cv[None, :] == cv[:, None]) & (i[None, :] < i[:, None]))  # [i, j]
    rank = tl.sum((before & ok[None, :]).to(tl.int32), axis=1)  # [NP]
    rank = tl.where(ok, rank, NP)
    s = tl.arange(0, KP)  # the next frontier's lanes
    s_ok = s < K
    pick = rank[None, :] == s[:, None]  # [KP, NP]: lane s takes candidate i
    best = tl.sum(tl.where(pick, i[None, :], 0), axis=1)  # [KP]
    best_score = tl.sum(tl.where(pick, cand[None, :], 0.0), axis=1)
    best_token = tl.sum(tl.where(pick, tokens[None, :], 0), axis=1)
    tl.store(next_front_ptr + b * K + s, best_score, mask=s_ok)
    tl.store(next_tokens_ptr + b * K + s, best_token, mask=s_ok)
    tl.store(next_frontier_ptr + b * K + s, base + best, mask=s_ok)
    lane = best // K  # each new node's parent, as a lane of this level
    length = tl.load(len_ptr + b)
    entry = length + depth * K + s  # the node's KV entry at the next level
    tl.store(entries_ptr + b * K + s, entry, mask=s_ok)
    tl.store(positions_ptr + b * K + s, length + depth + 0 * s, mask=s_ok)
    for c0 in range(0, H, BLOCK):  # inputs: the parent's pre-norm state
        c = c0 + tl.arange(0, BLOCK)
        m = s_ok[:, None] & (c[None, :] < H)
        row = tl.load(prenorm_ptr + (b * K + lane)[:, None] * H + c[None, :], mask=m, other=0.0)
        tl.store(inputs_ptr + (b * K + s)[:, None] * H + c[None, :], row, mask=m)
    # the view: the parent's, and its own entry. Every node sees the entries below `length`
    # (committed); the tree's lie in [length, entry], the only window that changes, in place:
    # a block's rows are all read before any is written (lanes take other lanes' views)
    for c0 in range(length, length + (depth + 1) * K, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = s_ok[:, None] & (c[None, :] < CTX)
        row = tl.load(vis_ptr + (b * K + lane)[:, None] * CTX + c[None, :], mask=m, other=0)
        row = tl.where(c[None, :] == entry[:, None], 1, row)
        tl.debug_barrier()
        tl.store(vis_ptr + (b * K + s)[:, None] * CTX + c[None, :], row, mask=m)
        tl.debug_barrier()


def tree_level(lp: torch.Tensor, ids: torch.Tensor, d2t: torch.Tensor, front_scores: torch.Tensor,
               frontier: torch.Tensor, lengths: torch.Tensor, prenorm: torch.Tensor, visible: torch.Tensor,
               base: int, depth: int) -> tuple[torch.Tensor, ...]:
    """One level of B trees of branching K: the children's log-probabilities lp [B, K, K] and
    draft ids [B, K, K] (each frontier node's top K), d2t [Vd], the frontier's cumulative scores
    [B, K] float64 and candidate indices [B, K], committed draft entries `lengths` [B], the
    level's pre-norm states [B, K, H] and views visible [B, K, ctx] (contiguous; updated in
    place to the next level's); `base` the candidate index of this level's first child, `depth`
    this level's (1 for the level after the roots). Returns the level's candidates (scores
    [B, K·K] float64, target ids, parents), the next frontier (scores [B, K], target ids,
    candidate indices), and the next level's inputs [B, K, H], views (`visible`), KV entries
    [B, K] and rotary positions [B, K]."""
    b, k, h = prenorm.shape
    ctx = visible.shape[-1]
    if not visible.is_contiguous():
        raise ValueError("tree_level updates the views in place: they must be contiguous")
    dev = lp.device
    scores = torch.empty(b, k * k, dtype=torch.float64, device=dev)
    tokens = torch.empty(b, k * k, dtype=torch.int64, device=dev)
    parents = torch.empty(b, k * k, dtype=torch.int64, device=dev)
    next_front = torch.empty(b, k, dtype=torch.float64, device=dev)
    next_tokens = torch.empty(b, k, dtype=torch.int64, device=dev)
    next_frontier = torch.empty(b, k, dtype=torch.int64, device=dev)
    inputs = torch.empty_like(prenorm)
    vis_u8 = visible.view(torch.uint8) if visible.dtype == torch.bool else visible
    entries = torch.empty(b, k, dtype=torch.int64, device=dev)
    positions = torch.empty(b, k, dtype=torch.int64, device=dev)
    _tree_level[(b,)](lp.contiguous(), ids.contiguous(), d2t, front_scores.contiguous(), frontier.contiguous(),
                      lengths.contiguous(), prenorm.contiguous(), vis_u8, scores, tokens, parents, next_front,
                      next_tokens, next_frontier, inputs, entries, positions, base, depth, h, ctx, K=k,
                      NP=triton.next_power_of_2(k * k), KP=triton.next_power_of_2(k), BLOCK=64, num_warps=4)
    return scores, tokens, parents, next_front, next_tokens, next_frontier, inputs, visible, entries, positions
