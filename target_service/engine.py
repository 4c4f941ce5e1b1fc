"""The target engine: prefill, verify (a chain of draft tokens in one forward), release.

Every tensor-parallel rank runs `execute` on the same plan and reaches the same state
(logits are gathered, samplers are seeded alike); rank 0 alone owns the hidden-state
ring and answers the gateway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specsplit.models.llama import LlamaModel
from specsplit.ops import (
    Code,
    OpError,
    Prefill,
    Release,
    Sampling,
    TargetOp,
    TargetResult,
    Verify,
)
from specsplit.sampling import select_token, verify_chain
from target_service.config import TargetConfig


@dataclass
class Sequence:
    slot: int
    length: int  # tokens whose KV entries are in the cache
    last_token: int  # emitted, not yet in the cache
    sampling: Sampling
    generator: torch.Generator


@dataclass
class Plan:
    """One batched step as every rank executes it. Rank 0 fills `rows_allowed`:
    False for entries whose ring allocation failed (answered RESOURCE_EXHAUSTED)."""

    ops: list[TargetOp]
    rows_allowed: list[bool] = field(default_factory=list)


@dataclass
class Outcome:
    result: TargetResult
    rows: torch.Tensor | None = None  # [n, 3H] features to hand to the draft


class TargetEngine:
    def __init__(self, cfg: TargetConfig, model: LlamaModel) -> None:
        self.cfg, self.model = cfg, model
        self.vocab = model.cfg.vocab_size
        self.cache = model.new_cache(cfg.max_sequences, cfg.max_context)
        self.free_slots = list(range(cfg.max_sequences - 1, -1, -1))
        self.seqs: dict[int, Sequence] = {}
        self.device = model.embed_tokens.weight.device

    # -- validation shared by rank 0 (before allocating ring rows) and every rank
    def check(self, op: TargetOp) -> None:
        if isinstance(op, Prefill):
            if op.seq_id in self.seqs:
                raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} is already open")
            if not op.prompt_ids:
                raise OpError(Code.INVALID_ARGUMENT, "empty prompt")
            if len(op.prompt_ids) >= self.cfg.max_context:
                raise OpError(Code.INVALID_ARGUMENT,
                              f"prompt of {len(op.prompt_ids)} tokens does not fit the context of "
                              f"{self.cfg.max_context}")
            self._check_ids(op.prompt_ids)
            if not self.free_slots:
                raise OpError(Code.RESOURCE_EXHAUSTED, "no free KV slot")
        elif isinstance(op, Verify):
            seq = self.seqs.get(op.seq_id)
            if seq is None:
                raise OpError(Code.NOT_FOUND, f"unknown sequence {op.seq_id}")
            if len(op.draft_ids) > self.cfg.max_draft_tokens:
                raise OpError(Code.INVALID_ARGUMENT,
                              f"{len(op.draft_ids)} draft tokens exceed the limit {self.cfg.max_draft_tokens}")
            if seq.length + 1 + len(op.draft_ids) > self.cfg.max_context:
                raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} would exceed the context")
            self._check_ids(op.draft_ids)
            if not seq.sampling.greedy and len(op.draft_dists) != len(op.draft_ids):
                raise OpError(Code.INVALID_ARGUMENT, "sampling verify needs one draft distribution per token")

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise OpError(Code.INVALID_ARGUMENT, f"token id {bad[0]} outside the vocabulary (0..{self.vocab - 1})")

    @staticmethod
    def rows_needed(op: TargetOp) -> int:
        if isinstance(op, Prefill) and op.capture:
            return len(op.prompt_ids)
        if isinstance(op, Verify) and op.capture:
            return len(op.draft_ids) + 1
        return 0

    def execute(self, plan: Plan) -> list[Outcome]:
        outcomes = []
        for i, op in enumerate(plan.ops):
            started = time.time_ns()
            try:
                if plan.rows_allowed and not plan.rows_allowed[i]:
                    raise OpError(Code.RESOURCE_EXHAUSTED, "hidden-state ring full; retry next cycle")
                self.check(op)
                if isinstance(op, Prefill):
                    outcomes.append(self._prefill(op))
                elif isinstance(op, Verify):
                    outcomes.append(self._verify(op))
                else:
                    outcomes.append(self._release(op))
            except OpError as e:
                outcomes.append(Outcome(TargetResult(op.seq_id, e.code, str(e))))
            outcomes[-1].result.started_ns, outcomes[-1].result.ended_ns = started, time.time_ns()
        return outcomes

    def _prefill(self, op: Prefill) -> Outcome:
        slot = self.free_slots.pop()
        gen = torch.Generator().manual_seed(op.sampling.seed)
        tokens = torch.tensor(op.prompt_ids, dtype=torch.long, device=self.device)
        logits, aux = self.model(tokens, 0, self.cache, slot, capture=op.capture)  # [P, V], [P, 3H]
        first = select_token(logits[-1], op.sampling, gen)
        self.seqs[op.seq_id] = Sequence(slot, len(op.prompt_ids), first, op.sampling, gen)
        return Outcome(TargetResult(op.seq_id, tokens=[first]), aux)

    def _verify(self, op: Verify) -> Outcome:
        seq = self.seqs[op.seq_id]
        tokens = torch.tensor([seq.last_token, *op.draft_ids], dtype=torch.long, device=self.device)
        logits, aux = self.model(tokens, seq.length, self.cache, seq.slot, capture=op.capture)  # [k+1, V]
        accepted, emitted = verify_chain(logits, op.draft_ids, op.draft_dists, seq.sampling, seq.generator)
        seq.length += accepted + 1  # last token and the accepted drafts are now in the cache
        seq.last_token = emitted[-1]
        rows = None if aux is None else aux[: accepted + 1]
        return Outcome(TargetResult(op.seq_id, tokens=emitted, num_accepted=accepted), rows)

    def _release(self, op: Release) -> Outcome:
        seq = self.seqs.pop(op.seq_id, None)
        if seq is not None:
            self.free_slots.append(seq.slot)
        return Outcome(TargetResult(op.seq_id))

