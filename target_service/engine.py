"""The target engine: prefill (a prompt whole or in parts), verify (a chain or a tree of draft
tokens in one forward), release.

Every tensor-parallel rank runs `execute` on the same plan and reaches the same state
(logits are gathered, sampled tokens drawn counter-based: specsplit.sampling); rank 0 alone
owns the hidden-state ring and answers the gateway.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from specsplit.models.fused import FusedLlama, fused_decode_unsupported
from specsplit.models.llama import LlamaModel
from specsplit.ops import (
    Code,
    OpError,
    Prefill,
    Recapture,
    Release,
    Resume,
    Sampling,
    Suspend,
    TargetOp,
    TargetResult,
    Verify,
)
from specsplit.runner.runner import ModelRunner, Row, Step, Verified
from specsplit.sampling import sampling_rows, select_token, verify_chain
from target_service.config import TargetConfig


@dataclass
class Sequence:
    slot: int  # -1: suspended (no KV entries)
    length: int  # tokens whose KV entries are in the cache
    last_token: int  # emitted, not yet in the cache (-1 until the whole prompt is in)
    sampling: Sampling
    epoch: int  # the lease under which it was opened
    tokens: list[int] = field(default_factory=list)  # the `length` tokens in the cache


@dataclass
class Plan:
    """One batched step as every rank executes it. Rank 0 fills `rows_allowed`:
    False for entries whose ring allocation failed (answered RESOURCE_EXHAUSTED), and
    `ring_rows`: where each entry's features go in the ring (-1: none). With `epoch` set, the
    engine first serves that lease (see TargetEngine.hold)."""

    ops: list[TargetOp]
    rows_allowed: list[bool] = field(default_factory=list)
    epoch: int | None = None
    ring_rows: list[int] = field(default_factory=list)


@dataclass
class Outcome:
    result: TargetResult
    rows: torch.Tensor | None = None  # [n, 3H] features to hand to the draft
    in_ring: int = 0  # instead: n rows of features the step wrote into the ring itself (at the plan's ring row)

    @property
    def feature_rows(self) -> int:
        return self.in_ring or (0 if self.rows is None else self.rows.shape[0])


@dataclass
class Work:
    """One entry of the batched forward."""

    index: int
    op: TargetOp
    seq: Sequence
    row: Row


class TargetEngine:
    def __init__(self, cfg: TargetConfig, model: LlamaModel) -> None:
        self.cfg, self.model = cfg, model
        self.vocab = model.cfg.vocab_size
        fused = None
        if cfg.fused_decode in ("on", "pdl") or (cfg.fused_decode == "auto" and fused_runs(model)):
            fused = FusedLlama(model, pdl={"on": False, "pdl": True}.get(cfg.fused_decode),
                               few_rows=None if cfg.few_rows < 0 else cfg.few_rows)
        # room for a padded verify past the context
        self.runner = ModelRunner(model, cfg.max_sequences, cfg.max_context + cfg.max_draft_tokens + 1,
                                  cuda_graphs=cfg.cuda_graphs, compile=cfg.compile, fused=fused,
                                  padded_tokens=cfg.max_draft_tokens + 1)
        self.seqs: dict[int, Sequence] = {}
        self.device = self.runner.device
        self.epoch = 0  # the lease new sequences belong to (0: none)

    def write_ring(self, ring: torch.Tensor | None) -> None:
        """Rank 0: the hidden-state ring [capacity, 3H] on this engine's device, which verify steps
        then write their features into themselves (at the plan's ring rows), or None."""
        self.runner.ring = ring

    # -- validation shared by rank 0 (before allocating ring rows) and every rank
    def check(self, op: TargetOp) -> None:
        if isinstance(op, Prefill):
            self._check_prefill(op)
        elif isinstance(op, (Verify, Recapture, Suspend, Resume)):
            seq = self.seqs.get(op.seq_id)
            if seq is None:
                raise OpError(Code.NOT_FOUND, f"unknown sequence {op.seq_id}")
            if seq.last_token < 0:
                raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} has not had its whole prompt yet")
            if type(op) is Verify and seq.slot >= 0:
                self._check_verify(op, seq)
                return
            if isinstance(op, Resume):
                if seq.slot >= 0:
                    raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} is not suspended")
                if not self.runner.free_slots:
                    raise OpError(Code.RESOURCE_EXHAUSTED, "no free KV slot")
                return
            if seq.slot < 0:
                raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} is suspended")
            if isinstance(op, Suspend):
                return
            if type(op) is Recapture:
                if not self.runner.free_slots:
                    raise OpError(Code.RESOURCE_EXHAUSTED, "no free KV slot to recompute features in")
                return

    def _check_prefill(self, op: Prefill) -> None:
        if not op.prompt_ids:
            raise OpError(Code.INVALID_ARGUMENT, "empty prompt")
        end = op.start + len(op.prompt_ids)
        if end >= self.cfg.max_context:
            raise OpError(Code.INVALID_ARGUMENT, f"prompt of {end} tokens does not fit the context of "
                                                 f"{self.cfg.max_context}")
        self._check_ids(op.prompt_ids)
        seq = self.seqs.get(op.seq_id)
        if op.start == 0:
            if seq is not None:
                raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} is already open")
            if not self.runner.free_slots:
                raise OpError(Code.RESOURCE_EXHAUSTED, "no free KV slot")
        elif seq is None or seq.last_token >= 0 or seq.slot < 0 or seq.length != op.start:
            raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} holds no part of a prompt of "
                                                 f"{op.start} tokens to go on from")

    def _check_verify(self, op: Verify, seq: Sequence) -> None:
        if len(op.draft_ids) > self.cfg.max_draft_tokens:
            raise OpError(Code.INVALID_ARGUMENT,
                          f"{len(op.draft_ids)} draft tokens exceed the limit {self.cfg.max_draft_tokens}")
        self._check_ids(op.draft_ids)
        if not seq.sampling.greedy and len(op.draft_dists) != len(op.draft_ids):
            raise OpError(Code.INVALID_ARGUMENT, "sampling verify needs one draft distribution per token")
        if op.draft_parents:
            self._check_tree(op, seq)
        if op.decode != 1:
            self._check_decode(op)
        if seq.length + len(op.draft_ids) + op.decode > self.cfg.max_context:
            raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} would exceed the context")
        if op.forced >= 0:
            if not self.cfg.forced_acceptance:
                raise OpError(Code.INVALID_ARGUMENT, "forced acceptance is a benchmark mode: start the target with "
                                                     "--benchmark-forced-acceptance")
            if not seq.sampling.greedy:
                raise OpError(Code.INVALID_ARGUMENT, "forced acceptance is for greedy sequences")

    def _check_decode(self, op: Verify) -> None:
        most = self.cfg.max_draft_tokens + 1
        if not 1 <= op.decode <= most:
            raise OpError(Code.INVALID_ARGUMENT, f"decode_tokens {op.decode} outside 1..{most}")
        if op.draft_ids or op.capture or op.forced >= 0:
            raise OpError(Code.INVALID_ARGUMENT, "a verify that decodes several tokens has no draft tokens, "
                                                 "captures no features and forces nothing")

    @staticmethod
    def _check_tree(op: Verify, seq: Sequence) -> None:
        if not seq.sampling.greedy:
            raise OpError(Code.INVALID_ARGUMENT, "a tree of draft tokens is verified greedily only; "
                                                 "sampled sequences verify a chain")
        if len(op.draft_parents) != len(op.draft_ids):
            raise OpError(Code.INVALID_ARGUMENT, f"{len(op.draft_parents)} parents for {len(op.draft_ids)} "
                                                 "draft tokens")
        if _row_parents(tuple(op.draft_parents)) is None:
            raise OpError(Code.INVALID_ARGUMENT, "each draft token's parent must come before it (or be -1)")

    def _check_ids(self, ids: list[int]) -> None:
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab):
            return
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise OpError(Code.INVALID_ARGUMENT, f"token id {bad[0]} outside the vocabulary (0..{self.vocab - 1})")

    def rows_needed(self, op: TargetOp) -> int:
        kind = type(op)
        if kind is Verify:
            return len(op.draft_ids) + 1 if op.capture else 0  # type: ignore[union-attr]
        if kind is Prefill:
            return len(op.prompt_ids) if op.capture else 0  # type: ignore[union-attr]
        if kind in (Recapture, Resume) and getattr(op, "capture", True) and op.seq_id in self.seqs:
            return max(self.seqs[op.seq_id].length, 1)
        return 0

    def execute(self, plan: Plan) -> list[Outcome]:
        """Validate every entry, run all prefills, verifies and recaptures in ONE forward,
        then accept per sequence. Errors stay with their entry."""
        if plan.epoch is not None:
            self.hold(plan.epoch)
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
                if isinstance(op, (Release, Suspend)):
                    outcomes[i] = self._release(op) if isinstance(op, Release) else self._suspend(op)
                    continue
                busy.add(op.seq_id)
                work.append(self._plan(i, op, plan.ring_rows[i] if plan.ring_rows else -1))
            except OpError as e:
                outcomes[i] = Outcome(TargetResult(op.seq_id, e.code, str(e)))
        if work:
            self._run(work, outcomes)
        ended = time.time_ns()
        for o in outcomes:
            assert o is not None
            o.result.started_ns, o.result.ended_ns = started, ended
        return outcomes  # type: ignore[return-value]

    def _plan(self, i: int, op: TargetOp, ring_row: int) -> Work:
        if type(op) is Prefill:
            if op.start:  # the next part of a prompt: only its last token's logits matter
                seq = self.seqs[op.seq_id]
                return Work(i, op, seq, Row(seq.slot, op.start, op.prompt_ids, last_only=True))
            seq = Sequence(self.runner.allocate(), 0, -1, op.sampling, self.epoch)
            self.seqs[op.seq_id] = seq
            return Work(i, op, seq, Row(seq.slot, 0, op.prompt_ids))
        seq = self.seqs[op.seq_id]
        if type(op) is Verify:  # the last emitted token, then the drafts (a tree under it: parents shifted)
            parents = _row_parents(tuple(op.draft_parents)) if op.draft_parents else None
            return Work(i, op, seq, Row(seq.slot, seq.length, [seq.last_token, *op.draft_ids], parents,
                                        seq.sampling.greedy, ring_row, op.forced))  # greedy: accepted in the step
        if isinstance(op, Resume):  # its committed tokens again, in a slot of its own
            seq.slot = self.runner.allocate()
            return Work(i, op, seq, Row(seq.slot, 0, seq.tokens))
        return Work(i, op, seq, Row(self.runner.allocate(), 0, seq.tokens))  # Recapture: in a scratch slot

    def _run(self, work: list[Work], outcomes: list[Outcome | None]) -> None:
        decodes: dict[int, list[Work]] = {}  # verifies of several tokens, by how many: a forward each
        for w in work:
            if type(w.op) is Verify and w.op.decode > 1:
                decodes.setdefault(w.op.decode, []).append(w)
        if decodes:
            for k, group in decodes.items():
                sampled = any(not w.seq.sampling.greedy for w in group)
                rows = sampling_rows([w.seq.sampling for w in group]) if sampled else None
                for w, tokens in zip(group, self.runner.decode(Step([w.row for w in group]), k, rows), strict=True):
                    outcomes[w.index] = self._decoded(w, tokens)
            work = [w for w in work if type(w.op) is not Verify or w.op.decode == 1]
            if not work:
                return
        capture = any(getattr(w.op, "capture", True) for w in work)
        try:
            verified = self.runner.verify(Step([w.row for w in work], capture=capture))
        finally:
            for w in work:
                if type(w.op) is Recapture:
                    self.runner.release(w.row.slot)
        for w, v in zip(work, verified, strict=True):
            outcomes[w.index] = self._finish(w, v)

    @staticmethod
    def _decoded(w: Work, tokens: list[int]) -> Outcome:
        seq = w.seq
        seq.tokens += [seq.last_token, *tokens[:-1]]
        seq.length += len(tokens)
        seq.last_token = tokens[-1]
        return Outcome(TargetResult(w.op.seq_id, tokens=tokens))

    def _finish(self, w: Work, v: Verified) -> Outcome:
        op, seq = w.op, w.seq
        capture = getattr(op, "capture", True)
        if type(op) is Verify:
            if w.row.accept:  # accepted in the step: the path's KV entries and features are in place
                path = v.path
                accepted = len(path) - 1
                emitted = [*(op.draft_ids[i - 1] for i in path[1:]), v.best[accepted]]
            else:
                accepted, emitted = verify_chain(v.logits, op.draft_ids, op.draft_dists, seq.sampling, seq.length + 1)
            seq.tokens.append(seq.last_token)
            seq.tokens += emitted[:accepted]
            seq.length += accepted + 1  # last token and the accepted drafts are now in the cache
            seq.last_token = emitted[-1]
            result = TargetResult(op.seq_id, tokens=emitted, num_accepted=accepted)
            if not capture:
                return Outcome(result)
            if v.in_ring:  # the path's rows first
                return Outcome(result, in_ring=accepted + 1)
            rows = v.features
            return Outcome(result, None if rows is None else rows[: accepted + 1])
        rows = v.features if capture else None
        if isinstance(op, Prefill):  # (a part of a prompt with more to come: nothing generated)
            seq.length = op.start + len(op.prompt_ids)
            seq.tokens += op.prompt_ids
            if op.more:
                return Outcome(TargetResult(op.seq_id), rows)
            seq.last_token = v.best[-1] if seq.sampling.greedy else select_token(v.logits[-1], seq.sampling,
                                                                                 seq.length)
            return Outcome(TargetResult(op.seq_id, tokens=[seq.last_token]), rows)
        # Recapture, Resume: features of positions 0..length-1 pair with tokens 1..length (the last not cached yet)
        return Outcome(TargetResult(op.seq_id, tokens=[*seq.tokens[1:], seq.last_token]), rows)

    def hold(self, epoch: int) -> int:
        """Serve the lease `epoch` (0: none) from now on: every sequence opened under another is
        released. Returns how many."""
        gone = [seq_id for seq_id, seq in self.seqs.items() if seq.epoch != epoch]
        for seq_id in gone:
            slot = self.seqs.pop(seq_id).slot
            if slot >= 0:
                self.runner.release(slot)
        self.epoch = epoch
        return len(gone)

    def _release(self, op: Release) -> Outcome:
        seq = self.seqs.pop(op.seq_id, None)
        if seq is not None and seq.slot >= 0:
            self.runner.release(seq.slot)
        return Outcome(TargetResult(op.seq_id))

    def _suspend(self, op: Suspend) -> Outcome:
        seq = self.seqs[op.seq_id]
        self.runner.release(seq.slot)
        seq.slot = -1  # no KV entries: a Resume prefills its tokens again
        return Outcome(TargetResult(op.seq_id))


@functools.lru_cache(maxsize=4096)
def _row_parents(draft_parents: tuple[int, ...]) -> tuple[int, ...] | None:
    """A tree of drafts' parents (each before it, or -1) as its verify row's: the last emitted
    token first, as the root, and each draft's parent shifted past it; None for an invalid tree.
    Cached: a draft's trees often repeat their shape."""
    if any(not -1 <= p < i for i, p in enumerate(draft_parents)):
        return None
    return (-1, *(p + 1 for p in draft_parents))


def fused_runs(model: LlamaModel) -> bool:
    """--fused-decode auto: the fused step wherever it runs (a CUDA device, Triton, a model it
    supports) on one rank. Under tensor parallelism it runs on each rank's shard, but auto keeps
    the padded path there until the fused step is measured against it (on / pdl ask for it)."""
    if model.embed_tokens.weight.device.type != "cuda" or fused_decode_unsupported(model) is not None:
        return False
    if model.tp.world_size > 1:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
