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
"""

from __future__ import annotations

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
