"""One step's metadata, read by every layer (nano-vllm's `Context`, SGLang's `ForwardBatch`).

Three layouts:
- ragged: sequences of their own lengths, tokens concatenated [N]; each attends to its own
  KV slot (eager steps);
- padded: B sequences of T tokens, flattened [B*T], described by tensors only, so that one
  CUDA graph serves every step of that shape;
- prompts: B sequences from entry 0, each padded to T tokens [B*T]; each sees only its own
  tokens, causally, so attention needs no mask and reads no cache (prefills, recomputes).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class Segment:
    """One sequence of a ragged batch: `length` tokens written to KV slot `slot` at entries
    start..start+length-1, at those rotary positions and causal, unless `positions` and
    `visible` say otherwise (the nodes of a tree: see tree_segment)."""

    slot: int
    start: int
    length: int
    positions: torch.Tensor | None = None  # [length] rotary positions
    visible: torch.Tensor | None = None  # [length, start + length] bool: the KV entries each token sees


@dataclass
class Batch:
    positions: torch.Tensor  # [N] rotary position of each token
    segments: list[Segment] | None = None  # ragged
    slots: torch.Tensor | None = None  # padded [B]: KV slot of each sequence
    entries: torch.Tensor | None = None  # padded [B, T]: KV entries the tokens write
    ctx: int = 0  # padded: keys [0, ctx) of each slot are read
    tree_mask: torch.Tensor | None = None  # padded [B, T, T] bool: which of the step's tokens each token sees
    visible: torch.Tensor | None = None  # padded [B, T, ctx] bool: which keys each token sees
    capture: bool = False  # target: also return the capture layers' outputs
    hidden: torch.Tensor | None = None  # head: [N, 3H] target features or [N, H] its own pre-norm states
    prompts: bool = False  # the prompts layout: slots [B], rows from entry 0, T = ctx tokens each
    logits_at: torch.Tensor | None = None  # [R] the tokens whose logits the model computes (None: every token)
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def ragged(cls, segments: list[Segment], device: torch.device | str, capture: bool = False,
               hidden: torch.Tensor | None = None) -> Batch:
        positions = torch.cat([torch.arange(s.start, s.start + s.length, device=device) if s.positions is None
                               else s.positions.to(device) for s in segments])
        return cls(positions, segments=segments, capture=capture, hidden=hidden)

    @classmethod
    def sequence(cls, tokens: torch.Tensor, start: int = 0, slot: int = 0, capture: bool = False,
                 hidden: torch.Tensor | None = None) -> Batch:
        """One sequence's tokens [T] after `start` committed entries of `slot`, causal."""
        return cls.ragged([Segment(slot, start, tokens.shape[0])], tokens.device, capture, hidden)

    @classmethod
    def padded(cls, positions: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor, ctx: int,
               tree_mask: torch.Tensor | None = None, visible: torch.Tensor | None = None, capture: bool = False,
               hidden: torch.Tensor | None = None) -> Batch:
        """positions, entries [B, T]; slots [B]. Each token sees the keys `visible` [B, T, ctx]
        names; else every entry before its row's first one plus the step's tokens that
        `tree_mask` [B, T, T] names (trees; the step's entries must then be consecutive); else
        every entry up to its own (causal). No host synchronisation: capturable."""
        b, t = entries.shape
        return cls(positions.reshape(b * t), slots=slots, entries=entries, ctx=ctx, tree_mask=tree_mask,
                   visible=visible, capture=capture, hidden=None if hidden is None else hidden.reshape(b * t, -1))

    @classmethod
    def prompt_rows(cls, ends: torch.Tensor, slots: torch.Tensor, t: int, capture: bool = False,
                    hidden: torch.Tensor | None = None) -> Batch:
        """B rows from entry 0 of their slots [B], each padded to t tokens, row i's last token at
        ends[i] of the flattened [B*T]: logits for each row's last token only ([B, V]), features
        for every token. Padding tokens write entries past their row that later steps overwrite.
        No host synchronisation: capturable."""
        b = slots.shape[0]
        return cls(torch.arange(t, device=slots.device).repeat(b), slots=slots, ctx=t, capture=capture, hidden=hidden,
                   prompts=True, logits_at=ends)

    @property
    def is_padded(self) -> bool:
        return self.segments is None and not self.prompts

    def allowed(self) -> torch.Tensor:
        """[B, T, ctx] bool: the keys each token of a padded batch sees."""
        if self.visible is None:
            assert self.entries is not None
            keys = torch.arange(self.ctx, device=self.entries.device)
            if self.tree_mask is None:
                self.visible = keys[None, None, :] <= self.entries[:, :, None]
            else:
                b, t = self.entries.shape
                rel = keys[None, None, :] - self.entries[:, :1, None]  # [B, 1, ctx] key - first entry
                mine = self.tree_mask.bool().gather(2, rel.clamp(0, t - 1).expand(b, t, self.ctx))
                self.visible = (rel < 0) | ((rel < t) & mine)
        return self.visible

    def grouped_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, group*T, ctx] for queries grouped per KV head (rows: member, token),
        made at the first layer and shared by the others."""
        key = (group, dtype)
        if key not in self._masks:
            allowed = self.allowed()[:, None]  # [B, 1, T, ctx]
            bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            bias.masked_fill_(~allowed, float("-inf"))
            self._masks[key] = bias.repeat(1, 1, group, 1)
        return self._masks[key]


@functools.lru_cache(maxsize=4096)
def tree_ancestry(parents: tuple[int, ...], t: int) -> tuple[np.ndarray, list[int]]:
    """A tree of n = len(parents) tokens (parents[i] < i; -1 for none, i.e. it follows the
    committed entries) -> its mask rows [n, t] (t >= n; each token's ancestors and itself) and
    each token's depth. Cached: a draft's trees often repeat their shape."""
    ancestors: list[int] = []  # as bits
    depth: list[int] = []
    for i, p in enumerate(parents):
        ancestors.append((ancestors[p] if p >= 0 else 0) | 1 << i)
        depth.append(depth[p] + 1 if p >= 0 else 0)
    return (np.array(ancestors, dtype=np.uint64)[:, None] >> np.arange(t, dtype=np.uint64)) & 1, depth


def tree_layout(start: int, parents: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """A tree (see tree_ancestry) at entries start..: each token's rotary position (start +
    depth) and the (token, entry) pairs of the tree that each token sees: its ancestors and
    itself. Plain lists: a whole tree's mask is then one indexed write."""
    mask, depth = tree_ancestry(tuple(parents), len(parents))
    rows, cols = np.nonzero(mask)
    return [start + d for d in depth], rows.tolist(), (cols + start).tolist()


def tree_segment(slot: int, start: int, parents: Sequence[int], device: torch.device | str = "cpu") -> Segment:
    """A tree (see tree_layout) as a ragged segment: each token sees the committed entries, its
    ancestors and itself. Built on the host, moved to `device` once (not in every layer)."""
    n = len(parents)
    positions, rows, cols = tree_layout(start, parents)
    visible = torch.zeros(n, start + n, dtype=torch.bool)
    visible[:, :start] = True
    visible[rows, cols] = True
    return Segment(slot, start, n, torch.tensor(positions, device=device), visible.to(device))
