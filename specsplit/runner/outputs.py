"""What a runner's step hands its engine: each row's logits and features as views of the step's
outputs, sliced only when asked for, and a verify row's accepted path."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specsplit.runner.packing import Row

# logits [T, V] ([1, V], the last token's, for a row from entry 0); captured features or pre-norm states [T, X]
RowOutput = tuple[torch.Tensor, torch.Tensor | None]


class RowOutputs:
    """Each row's (logits [T_i, V], features [T_i, X]) of a step: views of its outputs [N, ·],
    sliced only when asked for (a greedy row accepted on the device needs neither)."""

    def __init__(self, logits: torch.Tensor, extra: torch.Tensor | None, spans: list[tuple[int, int]],
                 logit_spans: list[tuple[int, int]] | None = None) -> None:
        self.logits, self.extra, self.spans = logits, extra, spans  # [N, V], [N, X]; each row's (start, end)
        self.logit_spans = spans if logit_spans is None else logit_spans  # where logits are fewer (prompts: the last)
        self.replaced: dict[int, torch.Tensor] = {}  # rows whose features were computed apart

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> RowOutput:
        return self.row_logits(i), self.row_features(i)

    def __iter__(self) -> Iterator[RowOutput]:
        return (self[i] for i in range(len(self.spans)))

    def row_logits(self, i: int) -> torch.Tensor:
        start, end = self.logit_spans[i]
        return self.logits[start:end]

    def row_features(self, i: int) -> torch.Tensor | None:
        if i in self.replaced:
            return self.replaced[i]
        start, end = self.spans[i]
        return None if self.extra is None else self.extra[start:end]


@dataclass
class Verified:
    """One row of a verify step (see specsplit.runner.acceptance). With `row.accept` the
    accepted path's KV entries already sit at start, start+1, ...; otherwise path is [0] and
    nothing moved."""

    outputs: RowOutputs  # the step's; this row's: `logits` [T, V], `features` [T, X] (the path's rows first)
    index: int
    path: list[int]  # the root (0) and the accepted drafts, as indices into the row's tokens
    best: list[int]  # the target's argmax after each token: the path's first, then the others'
    in_ring: bool = False  # the features (path first) are in the ring at the row's ring_row

    @property
    def logits(self) -> torch.Tensor:
        return self.outputs.row_logits(self.index)

    @property
    def features(self) -> torch.Tensor | None:
        return self.outputs.row_features(self.index)


def row_outputs(logits: torch.Tensor, extra: torch.Tensor | None, rows: list[Row], t: int) -> RowOutputs:
    """The rows of a padded step's outputs [B*T, ·], each T long."""
    return RowOutputs(logits, extra, [(i * t, i * t + len(r.tokens)) for i, r in enumerate(rows)])


def accepted_row(row: list[int], n: int) -> tuple[list[int], list[int]]:
    """One row's readback [accepted nodes, path (T), argmax along it (T)] for n real tokens ->
    (the accepted path, the argmax after each real token: the path's first)."""
    t = (len(row) - 1) // 2
    path, best = row[1 : 1 + t], row[1 + t :]
    return path[: row[0]], [best[j] for j in range(t) if path[j] < n]
