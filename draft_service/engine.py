"""The draft engine: extend (accepted tokens + their target features) then propose k.

Draft position p pairs the token at p+1 with the target's features of position p, so
after every extend the draft holds exactly as many positions as the target's cache.
Proposal steps past that write speculative KV entries that the next extend overwrites.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specsplit.handoff.base import HiddenReader
from specsplit.models.eagle3 import Eagle3Head
from specsplit.ops import Code, DraftOp, DraftResult, ExtendPropose, OpError, Release, Sampling, SparseDist
from specsplit.sampling import probs_from_logits, sample

_DRAFT_SEED_SALT = 0x9E3779B97F4A7C15  # the draft's sampler must not share the target's stream


@dataclass
class DraftSequence:
    slot: int
    length: int
    sampling: Sampling
    generator: torch.Generator


class DraftEngine:
    def __init__(self, head: Eagle3Head, max_sequences: int, max_context: int, max_steps: int) -> None:
        self.head, self.max_steps, self.max_context = head, max_steps, max_context
        self.cache = head.new_cache(max_sequences, max_context + max_steps)
        self.free_slots = list(range(max_sequences - 1, -1, -1))
        self.seqs: dict[int, DraftSequence] = {}
        self.reader: HiddenReader | None = None
        self.device = head.fc.weight.device
        self.vocab = head.cfg.vocab_size

    def execute(self, ops: list[DraftOp]) -> list[DraftResult]:
        results = []
        for op in ops:
            started = time.time_ns()
            try:
                if isinstance(op, ExtendPropose):
                    results.append(self._extend_propose(op))
                else:
                    results.append(self._release(op))
            except OpError as e:
                gen = op.hidden.generation if isinstance(op, ExtendPropose) else 0
                results.append(DraftResult(op.seq_id, e.code, str(e), consumed_generation=gen))
            results[-1].started_ns, results[-1].ended_ns = started, time.time_ns()
        return results

    def _open(self, op: ExtendPropose) -> DraftSequence:
        if not self.free_slots:
            raise OpError(Code.RESOURCE_EXHAUSTED, "no free draft KV slot")
        gen = torch.Generator().manual_seed((op.sampling.seed ^ _DRAFT_SEED_SALT) & (2**63 - 1))
        seq = DraftSequence(self.free_slots.pop(), 0, op.sampling, gen)
        self.seqs[op.seq_id] = seq
        return seq

    def _extend_propose(self, op: ExtendPropose) -> DraftResult:
        if self.reader is None:
            raise OpError(Code.INVALID_ARGUMENT, "no hidden-state store attached")
        rows = op.hidden.rows
        if rows != len(op.tokens) or rows == 0:
            raise OpError(Code.INVALID_ARGUMENT, f"{len(op.tokens)} tokens for {rows} feature rows")
        if op.num_steps > self.max_steps:
            raise OpError(Code.INVALID_ARGUMENT, f"num_steps {op.num_steps} exceeds the limit {self.max_steps}")
        if any(not 0 <= t < self.vocab for t in op.tokens):
            raise OpError(Code.INVALID_ARGUMENT, "token id outside the vocabulary")
        seq = self.seqs.get(op.seq_id)
        length = 0 if seq is None else seq.length
        if length + rows > self.max_context:
            raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} would exceed the draft context")
        feats = self.reader.read(op.hidden.offset, rows, op.hidden.inline).to(self.device)  # [rows, 3H]
        seq = seq or self._open(op)
        tokens = torch.tensor(op.tokens, dtype=torch.long, device=self.device)
        logits, prenorm = self.head(tokens, feats, seq.length, self.cache, seq.slot)  # [rows, Vd], [rows, H]
        seq.length += rows
        ids, dists = self._propose(seq, logits[-1], prenorm[-1:], op.num_steps)
        return DraftResult(op.seq_id, draft_ids=ids, draft_dists=dists, consumed_generation=op.hidden.generation)

    def _propose(self, seq: DraftSequence, logits: torch.Tensor, hidden: torch.Tensor, steps: int
                 ) -> tuple[list[int], list[SparseDist]]:
        ids: list[int] = []
        dists: list[SparseDist] = []
        for i in range(steps):
            if seq.sampling.greedy:
                draft_id = int(torch.argmax(logits))
            else:
                q = probs_from_logits(logits[None], seq.sampling)[0]  # [Vd]
                draft_id = sample(q, seq.generator)
                nz = torch.nonzero(q).flatten()
                dists.append((self.head.to_target_ids(nz).tolist(), q[nz].tolist()))
            token = int(self.head.to_target_ids(torch.tensor(draft_id, device=self.device)))
            ids.append(token)
            if i + 1 < steps:  # next step reads its own pre-norm state, not target features
                step_logits, hidden = self.head(torch.tensor([token], device=self.device), hidden,
                                                seq.length + i, self.cache, seq.slot)
                logits = step_logits[-1]
        return ids, dists

    def _release(self, op: Release) -> DraftResult:
        seq = self.seqs.pop(op.seq_id, None)
        if seq is not None:
            self.free_slots.append(seq.slot)
        return DraftResult(op.seq_id)
