"""Replay drafter (benchmarks and tests only): runs the real draft for its cost and its
state, then replaces its proposals with the target's own reference continuation, with
mistakes injected at a chosen per-token acceptance rate. Output from it must say
"replayed acceptance": the acceptance is chosen, not earned."""

from __future__ import annotations

import random

from gateway.clients import DraftClient
from specsplit.ops import DraftOp, DraftResult, ExtendPropose, StepTiming


class ReplayDraft:
    def __init__(self, inner: DraftClient, references: dict[int, list[int]], accept_rate: float, vocab: int,
                 seed: int = 0) -> None:
        """references: seq_id -> the full sequence (prompt + target-only greedy output)."""
        self.inner, self.references, self.accept_rate, self.vocab = inner, references, accept_rate, vocab
        self.rng = random.Random(seed)
        self.lengths: dict[int, int] = {}  # tokens the draft has consumed so far (prompt[1:] onwards)

    async def step(self, ops: list[DraftOp]) -> tuple[list[DraftResult], StepTiming]:
        results, timing = await self.inner.step(ops)
        by_op = {op.seq_id: op for op in ops if isinstance(op, ExtendPropose)}
        for r in results:
            op = by_op.get(r.seq_id)
            ref = self.references.get(r.seq_id)
            if op is None or ref is None or not r.draft_ids:
                continue
            # the draft has now seen tokens 1..n of the sequence; the next true token is ref[n + 1]
            n = self.lengths.get(r.seq_id, 0) + len(op.tokens)
            self.lengths[r.seq_id] = n
            ids = []
            for i in range(len(r.draft_ids)):
                true = ref[n + 1 + i] if n + 1 + i < len(ref) else 0
                ids.append(true if self.rng.random() < self.accept_rate else (true + 1) % self.vocab)
            r.draft_ids = ids
        return results, timing
