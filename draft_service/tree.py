"""Bookkeeping of one sequence's draft tree (EAGLE-2/3 dynamic trees, greedy).

Depth 1 holds the topk most likely tokens after the sequence. Each deeper level expands
the topk best nodes of the level above (by cumulative log-probability): the draft runs
those topk nodes in one forward, and each offers its own topk children, so a level has
topk * topk candidates of which the best topk are expanded in turn. At the end the best
num_draft_tokens - 1 candidates of all levels are kept. A child never scores above its
parent, so the kept set holds every kept node's ancestors.

Expanded nodes write draft KV entries after the committed ones (a level's nodes side by
side); each sees the committed entries, its ancestors' entries and its own. The next
extend overwrites them all.

Two implementations: `DraftTree` keeps one tree on the host (the eager path, one forward
and one host synchronisation per level), `grow_trees_static` grows a padded batch of trees
with tensors only (no host synchronisation: one CUDA graph for all levels). Both lay out
the candidates alike (level by level, each expanded node's children in its topk order) and
break score ties by index, so they build the same trees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specsplit.models.layers import Segment


@dataclass
class DraftTree:
    slot: int
    length: int  # committed draft entries; the tree's nodes follow
    topk: int
    keep: int  # draft tokens to keep (num_draft_tokens - 1)
    tokens: list[int] = field(default_factory=list)  # target ids, one per candidate node
    scores: list[float] = field(default_factory=list)  # cumulative log-probabilities
    parents: list[int] = field(default_factory=list)  # candidate index, -1 at depth 1
    depths: list[int] = field(default_factory=list)
    entries: dict[int, list[int]] = field(default_factory=dict)  # expanded node -> KV entries of it and its ancestors
    frontier: list[int] = field(default_factory=list)  # nodes to expand next
    next_entry: int = 0

    def __post_init__(self) -> None:
        self.next_entry = self.length

    def add(self, parent: int, tokens: list[int], logprobs: list[float]) -> None:
        """Candidates under `parent` (-1: the sequence) with their own log-probabilities."""
        base = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        for t, lp in zip(tokens, logprobs, strict=True):
            self.tokens.append(t)
            self.scores.append(base + min(lp, 0.0))
            self.parents.append(parent)
            self.depths.append(depth)

    def choose_frontier(self, first: int) -> None:
        """Expand next the topk best of the candidates added since index `first`."""
        fresh = range(first, len(self.tokens))
        self.frontier = sorted(fresh, key=lambda i: (-self.scores[i], i))[: self.topk]

    def frontier_segment(self, device: torch.device | str = "cpu") -> Segment:
        """The frontier's nodes as one segment: written side by side after the entries used so
        far, at position length + depth - 1 (the chain's position for that depth); its tensors
        moved to `device` once."""
        n, start = len(self.frontier), self.next_entry
        visible = torch.zeros(n, start + n, dtype=torch.bool)  # [n, start + n]
        visible[:, : self.length] = True
        for j, node in enumerate(self.frontier):
            parent = self.parents[node]
            own = [*(self.entries[parent] if parent >= 0 else []), start + j]
            self.entries[node] = own
            visible[j, own] = True
        self.next_entry += n
        positions = torch.tensor([self.length + self.depths[i] - 1 for i in self.frontier])
        return Segment(self.slot, start, n, positions.to(device), visible.to(device))

    def result(self) -> tuple[list[int], list[int]]:
        """The kept draft tokens in creation order (parents first) and their parents' indices
        in that list (-1: a child of the sequence)."""
        best = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i], i))[: self.keep]
        kept = sorted(best)
        index = {node: j for j, node in enumerate(kept)}
        parents = [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept]
        return [self.tokens[i] for i in kept], parents


StaticForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def grow_trees_static(forward: StaticForward, to_target_ids: Callable[[torch.Tensor], torch.Tensor],
                      logits: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                      topk: int, steps: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grow B trees of `steps` levels at once. logits [B, Vd] and hidden [B, H] of each
    sequence after its extend; lengths [B] committed draft entries; slots [B].
    `forward(tokens, hidden, positions, slots, ctx, entries, visible)` is the head's static
    forward. Returns, for the N = topk + (steps - 1) * topk² candidates of each tree: target
    ids [B, N], parents [B, N] (candidate index, -1 under the sequence) and the candidates
    best first [B, N] (stable: ties keep index order, so parents come before children)."""
    b, k, h = logits.shape[0], topk, hidden.shape[-1]
    lp, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, K]
    front_scores = lp.double().clamp(max=0.0)  # cumulative log-probabilities, as DraftTree's floats
    front_tokens = to_target_ids(ids)  # [B, K]
    tokens, scores = [front_tokens], [front_scores]
    parents = [torch.full((b, k), -1, dtype=torch.long, device=logits.device)]
    frontier = torch.arange(k, device=logits.device).expand(b, k)  # candidate index of each frontier node
    inputs = hidden[:, None].expand(b, k, h)  # [B, K, H]
    keys = torch.arange(ctx, device=logits.device)
    seen = (keys[None, :] < lengths[:, None])[:, None].expand(b, k, ctx)  # [B, K, ctx] committed entries
    lane = torch.arange(k, device=logits.device)
    for depth in range(1, steps):
        entries = lengths[:, None] + (depth - 1) * k + lane  # [B, K] a level's nodes side by side
        positions = (lengths + depth - 1)[:, None].expand(b, k)  # the chain's position for this depth
        visible = seen | (keys == entries[..., None])  # [B, K, ctx]
        out, prenorm = forward(front_tokens, inputs, positions, slots, ctx, entries, visible)  # [B,K,Vd], [B,K,H]
        lp, ids = torch.log_softmax(out.float(), dim=-1).topk(k, dim=-1)  # [B, K, K]
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
    all_scores = torch.cat(scores, dim=1)
    order = torch.sort(all_scores, dim=-1, descending=True, stable=True).indices
    return torch.cat(tokens, dim=1), torch.cat(parents, dim=1), order


def static_tree_result(tokens: list[int], parents: list[int], order: list[int], topk: int, steps: int,
                       keep: int) -> tuple[list[int], list[int]]:
    """One row of grow_trees_static, cut to a tree of `steps` levels (a batch grows its
    deepest) and its best `keep` candidates, as DraftTree.result gives them."""
    n = topk + (steps - 1) * topk * topk  # candidates of the first `steps` levels
    kept = sorted([i for i in order if i < n][:keep])
    index = {node: j for j, node in enumerate(kept)}
    return [tokens[i] for i in kept], [index[parents[i]] if parents[i] >= 0 else -1 for i in kept]
