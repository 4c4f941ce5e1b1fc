"""The target engine: prefill, verify (a chain or a tree of draft tokens in one forward), release.

Every tensor-parallel rank runs `execute` on the same plan and reaches the same state
(logits are gathered, samplers are seeded alike); rank 0 alone owns the hidden-state
ring and answers the gateway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypeGuard

import torch

from specsplit.models.cuda_graphs import GraphCache, bucket_up, compile_static, pow2_buckets
from specsplit.models.fused_decode import FusedDecode
from specsplit.models.layers import Segment, tree_layout, tree_segment
from specsplit.models.llama import LlamaModel
from specsplit.ops import (
    Code,
    OpError,
    Prefill,
    Recapture,
    Release,
    Sampling,
    TargetOp,
    TargetResult,
    Verify,
)
from specsplit.sampling import select_token, verify_chain, verify_tree
from target_service.config import TargetConfig


@dataclass
class Sequence:
    slot: int
    length: int  # tokens whose KV entries are in the cache
    last_token: int  # emitted, not yet in the cache (-1 until the prefill has run)
    sampling: Sampling
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # the `length` tokens in the cache


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


@dataclass
class Work:
    """One entry of the batched forward."""

    index: int
    op: TargetOp
    seq: Sequence
    tokens: list[int]
    start: int
    slot: int


class TargetEngine:
    def __init__(self, cfg: TargetConfig, model: LlamaModel) -> None:
        self.cfg, self.model = cfg, model
        self.vocab = model.cfg.vocab_size
        # one extra slot takes the padding rows of static batches; room for a padded verify past the context
        self.pad_slot = cfg.max_sequences
        self.cache = model.new_cache(cfg.max_sequences + 1, cfg.max_context + cfg.max_draft_tokens + 1)
        self.free_slots = list(range(cfg.max_sequences - 1, -1, -1))
        self.seqs: dict[int, Sequence] = {}
        self.device = model.embed_tokens.weight.device
        self.graphs = GraphCache(self.device, cfg.cuda_graphs)
        # padded static batches on CUDA, with or without graphs (the same kernels either way); tests turn them on on CPU
        self.use_static = self.device.type == "cuda"
        self.static_fn = compile_static(model.static_forward) if cfg.compile else model.static_forward
        # steps of one sequence (decode, chain and tree verifies): the fused Triton step
        # (specsplit.models.fused_decode), if asked for
        self.fused = FusedDecode(model, pdl=cfg.fused_decode == "pdl") if cfg.fused_decode != "off" else None
        self.batch_buckets = pow2_buckets(1, cfg.max_sequences)
        self.ctx_buckets = pow2_buckets(min(128, self.cache.max_len), self.cache.max_len)

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
        elif isinstance(op, Verify | Recapture):
            seq = self.seqs.get(op.seq_id)
            if seq is None or seq.last_token < 0:
                raise OpError(Code.NOT_FOUND, f"unknown sequence {op.seq_id}")
            if isinstance(op, Recapture):
                if not self.free_slots:
                    raise OpError(Code.RESOURCE_EXHAUSTED, "no free KV slot to recompute features in")
                return
            if len(op.draft_ids) > self.cfg.max_draft_tokens:
                raise OpError(Code.INVALID_ARGUMENT,
                              f"{len(op.draft_ids)} draft tokens exceed the limit {self.cfg.max_draft_tokens}")
            if seq.length + 1 + len(op.draft_ids) > self.cfg.max_context:
                raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} would exceed the context")
            self._check_ids(op.draft_ids)
            if not seq.sampling.greedy and len(op.draft_dists) != len(op.draft_ids):
                raise OpError(Code.INVALID_ARGUMENT, "sampling verify needs one draft distribution per token")
            if op.draft_parents:
                self._check_tree(op, seq)

    @staticmethod
    def _check_tree(op: Verify, seq: Sequence) -> None:
        if not seq.sampling.greedy:
            raise OpError(Code.INVALID_ARGUMENT, "a tree of draft tokens is verified greedily only; "
                                                 "sampled sequences verify a chain")
        if len(op.draft_parents) != len(op.draft_ids):
            raise OpError(Code.INVALID_ARGUMENT, f"{len(op.draft_parents)} parents for {len(op.draft_ids)} "
                                                 "draft tokens")
        if any(not -1 <= p < i for i, p in enumerate(op.draft_parents)):
            raise OpError(Code.INVALID_ARGUMENT, "each draft token's parent must come before it (or be -1)")

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise OpError(Code.INVALID_ARGUMENT, f"token id {bad[0]} outside the vocabulary (0..{self.vocab - 1})")

    def rows_needed(self, op: TargetOp) -> int:
        if isinstance(op, Prefill) and op.capture:
            return len(op.prompt_ids)
        if isinstance(op, Verify) and op.capture:
            return len(op.draft_ids) + 1
        if isinstance(op, Recapture) and op.seq_id in self.seqs:
            return max(self.seqs[op.seq_id].length, 1)
        return 0

    def execute(self, plan: Plan) -> list[Outcome]:
        """Validate every entry, run all prefills, verifies and recaptures in ONE forward,
        then accept per sequence. Errors stay with their entry."""
        started = time.time_ns()
        outcomes: list[Outcome | None] = [None] * len(plan.ops)
        work: list[Work] = []
        busy: set[int] = set()
        for i, op in enumerate(plan.ops):
            try:
                if plan.rows_allowed and not plan.rows_allowed[i]:
                    raise OpError(Code.RESOURCE_EXHAUSTED, "hidden-state ring full; retry next cycle")
                if op.seq_id in busy:
                    raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} appears twice in one step")
                self.check(op)
                if isinstance(op, Release):
                    outcomes[i] = self._release(op)
                    continue
                busy.add(op.seq_id)
                work.append(self._plan(i, op))
            except OpError as e:
                outcomes[i] = Outcome(TargetResult(op.seq_id, e.code, str(e)))
        if work:
            self._run(work, outcomes)
        ended = time.time_ns()
        for o in outcomes:
            assert o is not None
            o.result.started_ns, o.result.ended_ns = started, ended
        return outcomes  # type: ignore[return-value]

    def _plan(self, i: int, op: TargetOp) -> Work:
        if isinstance(op, Prefill):
            gen = torch.Generator(device=self.device).manual_seed(op.sampling.seed)  # where the logits are
            seq = Sequence(self.free_slots.pop(), 0, -1, op.sampling, gen)
            self.seqs[op.seq_id] = seq
            return Work(i, op, seq, op.prompt_ids, 0, seq.slot)
        seq = self.seqs[op.seq_id]
        if isinstance(op, Verify):
            return Work(i, op, seq, [seq.last_token, *op.draft_ids], seq.length, seq.slot)
        return Work(i, op, seq, seq.tokens, 0, self.free_slots.pop())  # Recapture: in a scratch slot

    def _run(self, work: list[Work], outcomes: list[Outcome | None]) -> None:
        capture = any(getattr(w.op, "capture", True) for w in work)
        try:
            parts = self._forward_static(work, capture) if self._static(work) else self._forward_eager(work, capture)
        finally:
            self.free_slots += [w.slot for w in work if isinstance(w.op, Recapture)]
        for w, (logits, rows) in zip(work, parts, strict=True):
            outcomes[w.index] = self._finish(w, logits, rows if getattr(w.op, "capture", True) else None)

    def _static(self, work: list[Work]) -> bool:
        """Verifies (decode = a verify of no drafts), chains and trees, run as a padded static batch
        in a CUDA graph."""
        return self.use_static and all(isinstance(w.op, Verify) for w in work)

    def _forward_eager(self, work: list[Work], capture: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        tokens = torch.tensor([t for w in work for t in w.tokens], dtype=torch.long, device=self.device)
        segments = [tree_segment(w.slot, w.start, _tree_parents(w.op), self.device) if _is_tree(w.op)
                    else Segment(w.slot, w.start, len(w.tokens)) for w in work]
        logits, aux = self.model.forward_batch(tokens, segments, self.cache, capture)  # [N, V], [N, 3H]
        parts, off = [], 0
        for w in work:
            part = slice(off, off + len(w.tokens))
            off += len(w.tokens)
            parts.append((logits[part], None if aux is None else aux[part]))
        return parts

    def _forward_static(self, work: list[Work], capture: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """B sequences padded to the batch bucket, each to the longest chain T; padding rows write
        the spare slot, padding tokens write KV entries past the sequence that later steps overwrite."""
        b = bucket_up(len(work), self.batch_buckets)
        t = max(len(w.tokens) for w in work)
        ctx = bucket_up(max(w.start for w in work) + t, self.ctx_buckets)
        assert b is not None and ctx is not None
        if self.fused is not None and len(work) == 1 and t <= self.fused.max_rows:
            return [self._run_fused(work[0], capture)]
        pad = b - len(work)
        tokens = torch.tensor([[*w.tokens, *[0] * (t - len(w.tokens))] for w in work] + [[0] * t] * pad)  # [B, T]
        positions = torch.tensor([list(range(w.start, w.start + t)) for w in work] + [list(range(t))] * pad)
        slots = torch.tensor([w.slot for w in work] + [self.pad_slot] * pad)
        if any(_is_tree(w.op) for w in work):
            return self._run_static_tree(work, tokens, positions, slots, ctx, capture)

        def fn(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> tuple:
            return self.static_fn(tokens, positions, slots, ctx, self.cache, capture)

        with torch.no_grad() if self.cfg.compile else torch.inference_mode():
            logits, aux = self.graphs.run((b, t, ctx, capture), fn, tokens=tokens, positions=positions,
                                          slots=slots)  # host tensors: one copy each into the graph's inputs
        assert logits is not None
        return [(logits[i, : len(w.tokens)], None if aux is None else aux[i, : len(w.tokens)])
                for i, w in enumerate(work)]

    def _run_fused(self, w: Work, capture: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence's step (a decode, a chain or a tree of T tokens) as the fused step, from a
        graph of its own per T. Its inputs travel in one host tensor, one copy: tokens, rotary
        positions, KV entries start.., the slot, the [T, T] mask (token i sees new token j)."""
        assert self.fused is not None
        t = len(w.tokens)
        entries = list(range(w.start, w.start + t))
        if _is_tree(w.op):
            positions, rows, cols = tree_layout(w.start, _tree_parents(w.op))
            mask = torch.zeros(t, t, dtype=torch.long)
            mask[rows, [c - w.start for c in cols]] = 1
        else:
            positions, mask = entries, torch.ones(t, t, dtype=torch.long).tril()
        packed = torch.cat([torch.tensor([*w.tokens, *positions, *entries, w.slot]), mask.view(-1)])
        fused = self.fused

        def fn(packed: torch.Tensor) -> tuple:
            tokens, positions, entries = (packed[i * t : (i + 1) * t].view(1, t) for i in range(3))
            slots, mask = packed[3 * t : 3 * t + 1], packed[3 * t + 1 :].view(t, t)
            return fused(tokens, positions, slots, 0, self.cache, capture, entries, mask)

        with torch.inference_mode():
            logits, aux = self.graphs.run(("fused", t, capture), fn, packed=packed)
        assert logits is not None
        return logits[0], None if aux is None else aux[0]

    def _run_static_tree(self, work: list[Work], tokens: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor,
                         ctx: int, capture: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """A static batch holding trees (graphs of their own key): rows write KV entries start.. in
        order, at rotary positions start + depth, seeing the committed entries, their ancestors
        and themselves (chain rows and padding tokens: everything up to their own entry)."""
        b, t = tokens.shape
        keys = torch.arange(ctx)
        visible = keys[None, None, :] <= entries[:, :, None]  # [B, T, ctx] causal
        positions = entries.clone()
        for i, w in enumerate(work):
            if _is_tree(w.op):  # on the host, a few writes per tree (not per node)
                tree_positions, rows, cols = tree_layout(w.start, _tree_parents(w.op))
                n = len(tree_positions)
                positions[i, :n] = torch.tensor(tree_positions)
                visible[i, :n, w.start :] = False
                visible[i, rows, cols] = True

        def fn(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor,
               visible: torch.Tensor) -> tuple:
            return self.static_fn(tokens, positions, slots, ctx, self.cache, capture, entries, visible)

        with torch.no_grad() if self.cfg.compile else torch.inference_mode():
            logits, aux = self.graphs.run((b, t, ctx, capture, "tree"), fn, tokens=tokens, positions=positions,
                                          slots=slots, entries=entries, visible=visible)  # host tensors
        assert logits is not None
        return [(logits[i, : len(w.tokens)], None if aux is None else aux[i, : len(w.tokens)])
                for i, w in enumerate(work)]

    def _finish(self, w: Work, logits: torch.Tensor, rows: torch.Tensor | None) -> Outcome:
        op, seq = w.op, w.seq
        if isinstance(op, Prefill):
            first = select_token(logits[-1], op.sampling, seq.generator)
            seq.length, seq.last_token, seq.tokens = len(op.prompt_ids), first, list(op.prompt_ids)
            return Outcome(TargetResult(op.seq_id, tokens=[first]), rows)
        if _is_tree(op):
            return self._finish_tree(w, op, logits, rows)
        if isinstance(op, Verify):
            accepted, emitted = verify_chain(logits, op.draft_ids, op.draft_dists, seq.sampling, seq.generator)
            seq.tokens += [seq.last_token, *op.draft_ids[:accepted]]
            seq.length += accepted + 1  # last token and the accepted drafts are now in the cache
            seq.last_token = emitted[-1]
            return Outcome(TargetResult(op.seq_id, tokens=emitted, num_accepted=accepted),
                           None if rows is None else rows[: accepted + 1])
        # Recapture: features of positions 0..length-1 pair with tokens 1..length (the last one not cached yet)
        return Outcome(TargetResult(op.seq_id, tokens=[*seq.tokens[1:], seq.last_token]), rows)

    def _finish_tree(self, w: Work, op: Verify, logits: torch.Tensor, rows: torch.Tensor | None) -> Outcome:
        """Accept the tree's longest matching path, then move the path's KV entries (written at
        start + node index) to start + depth, where the committed sequence continues."""
        seq = w.seq
        path, emitted = verify_tree(logits, op.draft_ids, op.draft_parents)
        if path != list(range(len(path))):
            src = torch.tensor(path, device=self.device) + w.start
            dst = torch.arange(len(path), device=self.device) + w.start
            for kv in (self.cache.k, self.cache.v):  # [layers, slots, entries, kv_heads, head_dim]
                kv[:, w.slot, dst] = kv[:, w.slot, src]
        accepted = len(path) - 1
        seq.tokens += [seq.last_token, *emitted[:accepted]]
        seq.length += accepted + 1
        seq.last_token = emitted[-1]
        kept = None if rows is None else rows[torch.tensor(path, device=rows.device)]
        return Outcome(TargetResult(op.seq_id, tokens=emitted, num_accepted=accepted), kept)

    def _release(self, op: Release) -> Outcome:
        seq = self.seqs.pop(op.seq_id, None)
        if seq is not None:
            self.free_slots.append(seq.slot)
        return Outcome(TargetResult(op.seq_id))


def _is_tree(op: TargetOp) -> TypeGuard[Verify]:
    return isinstance(op, Verify) and bool(op.draft_parents)


def _tree_parents(op: Verify) -> list[int]:
    """The verified tokens' parents: [last, d1..dn] with `last` the root (draft parent -1 -> 0)."""
    return [-1, *(p + 1 for p in op.draft_parents)]
