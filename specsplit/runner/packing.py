"""A padded step's integers as one host array (the runner's padded and fused paths): each row's
tokens, rotary positions and KV entries, the slots, tree masks, the acceptance's fields and the
ring rows side by side, field-major, so that on the device every field is a view of one copy."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specsplit.models.batch import tree_ancestry
from specsplit.runner.acceptance import row_fields


@dataclass
class Row:
    """One sequence's new tokens: they write KV entries start, start+1, ... of `slot`."""

    slot: int
    start: int  # committed entries of the slot, all visible to the row
    tokens: list[int]
    parents: Sequence[int] | None = None  # a tree: each token's parent in `tokens` (-1: after the committed entries)
    accept: bool = False  # verify: accept the drafts after tokens[0] greedily on the device
    ring_row: int = -1  # verify: where its features go in the runner's ring (-1: not written by the step)
    forced: int = -1  # with accept: accept this many down the deepest path (a benchmark mode)
    last_only: bool = False  # eager: only its last token's logits (a part of a prompt)


@dataclass
class StepLayout:
    """Where each field of a packed step sits: field-major, so that every field is a view."""

    b: int
    t: int
    tree: bool
    verify: bool
    ring: bool = False

    def shapes(self) -> dict[str, tuple[int, ...]]:
        b, t = self.b, self.t
        out: dict[str, tuple[int, ...]] = {"tokens": (b, t), "positions": (b, t), "entries": (b, t), "slots": (b,)}
        if self.tree:
            out["mask"] = (b, t, t)
        if self.verify:
            out["fields"] = (2, b, t)  # parent, expect
        if self.ring:
            out["ring_dst"] = out["ring_src"] = (b * t,)
        return out

    def unpack(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields as views of `packed`; "fields" as [B, 2, T]."""
        out, at = {}, 0
        for name, shape in self.shapes().items():
            n = math.prod(shape)
            out[name], at = packed[at : at + n].view(shape), at + n
        if self.verify:
            out["fields"] = out["fields"].transpose(0, 1)
        return out


def pack_rows(rows: list[Row], b: int, t: int, tree: bool, verify: bool, ring: bool = False
              ) -> tuple[np.ndarray, StepLayout]:
    """b rows, each padded to t tokens, as one host array of fields side by side: tokens,
    rotary positions, entries [B, T]; slots [B]; with `tree`, masks [B, T, T] (each token's
    ancestors and itself: causal for chains and padding); with `verify`, the acceptance's
    parent and expect [2, B, T] (see specsplit.runner.acceptance); with `ring`, for each of B·T
    writes the ring row and the step's row of features that goes there: each real token of
    a row with a ring_row, then repeats of the first such write (same row, same value)."""
    fields: list[list[int]] = [[], [], [], []]  # tokens, positions, entries, slots
    accept: list[list[int]] = [[], []]  # parent, expect
    masks: list[np.ndarray] = []  # [T, T] each
    for row in rows:
        n, entries = len(row.tokens), list(range(row.start, row.start + t))
        positions = entries
        if tree and row.parents:
            mask, offsets = _tree_row(tuple(row.parents), t)
            masks.append(mask)
            positions = [row.start + d for d in offsets]
        elif tree:
            masks.append(_causal(t))
        fields[0] += [*row.tokens, *[0] * (t - n)]
        fields[1] += positions
        fields[2] += entries
        fields[3].append(row.slot)
        if verify:
            parent, expect = row_fields(row.tokens, row.parents, row.accept, t, row.forced)
            accept[0] += parent
            accept[1] += expect
    writes: list[int] = []  # the ring's rows, then the features' rows
    if ring:
        dst: list[int] = []
        src: list[int] = []
        for i, row in enumerate(rows):
            if row.ring_row >= 0:
                dst += range(row.ring_row, row.ring_row + len(row.tokens))
                src += range(i * t, i * t + len(row.tokens))
        fill = b * t - len(dst)
        writes = [*dst, *[dst[0]] * fill, *src, *[src[0]] * fill]
    ints = np.array(fields[0] + fields[1] + fields[2] + fields[3] + accept[0] + accept[1] + writes, dtype=np.int64)
    if tree:  # the masks sit between the slots and the acceptance's fields
        cut = 3 * b * t + b
        ints = np.concatenate([ints[:cut], *(mask.ravel() for mask in masks), ints[cut:]])
    return ints, StepLayout(b, t, tree, verify, ring)


@functools.cache
def _causal(t: int) -> np.ndarray:
    return np.tril(np.ones((t, t), dtype=np.int64))


@functools.lru_cache(maxsize=4096)
def _tree_row(parents: tuple[int, ...], t: int) -> tuple[np.ndarray, list[int]]:
    """A tree row's mask [T, T] (its nodes' ancestry, then the padding's causal rows) and each
    token's rotary offset from the row's start (a node's depth, then the padding's index).
    Cached: a draft's trees often repeat their shape."""
    mask, depth = tree_ancestry(parents, t)
    full = _causal(t).copy()
    full[: len(parents)] = mask
    return full, [*depth, *range(len(parents), t)]


def padded_rows(rows: list[torch.Tensor], b: int, t: int) -> torch.Tensor:
    """Rows [T_i, W] as [b, t, W], zero-padded (a view when one row fills the batch)."""
    if b == 1 and rows[0].shape[0] == t:
        return rows[0][None]
    out = rows[0].new_zeros(b, t, rows[0].shape[-1])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out
