"""The draft engine: extend (accepted tokens + their target features), then propose a chain of
k tokens or a tree k levels deep. Draft position p pairs the token at p+1 with the target's
features of position p, so after every extend the draft holds exactly as many positions as the
target's cache. Proposal steps past that write speculative KV entries that the next extend
overwrites.

A cycle, for every sequence of the batch at once:
1. extend: one model step over each sequence's new tokens (`ModelRunner.run`);
2. propose: greedy chains and trees grow with tensors only (draft_service.tree, one graph per
   topk); sampled chains draw each token on the host, one model step per draft token.
When every sequence is greedy with one topk and its extend is short (the usual cycle), 1 and 2
are one function in one CUDA graph, fed by one host copy and read back once. Drafting ahead (the
next cycle's proposal while the target verifies): draft_service.ahead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from draft_service.ahead import check_ahead, draft_ahead, keep_last
from draft_service.tree import fused_top_k, grow_trees, unpack_trees
from specsplit.forced import ForcedAcceptance
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.fused_head import fused_head, level_kernel
from specsplit.ops import (
    MAX_EARLIER,
    PUT_OFF_TOKENS,
    AheadOutcome,
    Code,
    DraftOp,
    DraftResult,
    ExtendPropose,
    OpError,
    Release,
    Sampling,
    SparseDist,
    draft_cycle_entries,
    extend_bucket,
)
from specsplit.runner.runner import ModelRunner, Row, Step, padded_rows
from specsplit.sampling import probs_from_logits, sample
from specsplit.transport.handoff.base import HiddenReader

log = logging.getLogger("specsplit.draft")
_DRAFT_SEED_SALT = 0x9E3779B97F4A7C15  # the draft's sampler must not share the target's stream


@dataclass
class DraftSequence:
    slot: int
    length: int  # committed draft entries
    sampling: Sampling
    generator: torch.Generator
    epoch: int  # the lease under which it was opened


@dataclass
class Work:
    """One ExtendPropose entry of a step."""

    index: int
    op: ExtendPropose
    seq: DraftSequence
    features: torch.Tensor | None  # [len(op.tokens), 3H] the target's, read from the hidden-state store
    rows: list[int] | None = None  # or where they sit in the ring, read in the step (None: `features`)

    def read(self, ring: torch.Tensor | None) -> torch.Tensor:
        """The features [len(op.tokens), 3H], gathered from the ring where they were not read."""
        if self.features is None:
            assert ring is not None and self.rows is not None
            self.features = ring[torch.tensor(self.rows, device=ring.device)]
        return self.features

    @property
    def greedy_shape(self) -> tuple[int, int, int] | None:
        """(topk, steps, tokens to keep) of a greedy proposal, None for a sampled one or none."""
        op = self.op
        if op.num_steps == 0 or not self.seq.sampling.greedy:
            return None
        return op.topk, op.num_steps, op.num_draft_tokens - 1 if op.topk > 1 else op.num_steps


@dataclass
class Proposal:
    ids: list[int] = field(default_factory=list)  # target token ids
    dists: list[SparseDist] = field(default_factory=list)  # sampled chains: q of each token
    parents: list[int] = field(default_factory=list)  # trees: each token's parent (-1: the sequence)
    ahead: list[AheadOutcome] = field(default_factory=list)  # drafting ahead's (draft_service.ahead)


class DraftEngine:
    def __init__(self, head: Eagle3Head, max_sequences: int, max_context: int, max_steps: int,
                 cuda_graphs: bool = True, compile: bool = False, max_topk: int = 8, fused: str = "auto",
                 ahead_slots: int = 0, tree_profile: ForcedAcceptance | None = None) -> None:
        self.head, self.max_steps, self.max_context, self.max_topk = head, max_steps, max_context, max_topk
        self.max_sequences, self.ahead_slots = max_sequences, ahead_slots
        # extends of up to max_steps + 1 tokens (a cycle's) or PUT_OFF_TOKENS (those put off, gateway.phases) run
        # padded, from graphs on CUDA; room for them, chains and trees past the context
        longest = max(max_steps + 1, PUT_OFF_TOKENS)
        room = extend_bucket(longest) + max_steps + 1 + max_steps * max_topk
        # compile: on CUDA with graphs each cycle's graph compiled whole (static shapes), else the padded forward
        cuda = next(head.parameters()).device.type == "cuda"
        whole = compile and cuda_graphs and cuda
        fused_step = fused_head(head, fused) if cuda and not compile else None  # compiled: the padded path
        slots = max_sequences + ahead_slots  # (draft_service.ahead: its outcomes' scratch slots)
        self.runner = ModelRunner(head, slots, max_context + room, cuda_graphs=cuda_graphs,
                                  compile=compile and not whole, compile_graphs=whole, padded_tokens=longest,
                                  row_bucket=extend_bucket, fused_head=fused_step)
        self.seqs: dict[int, DraftSequence] = {}
        self.reader: HiddenReader | None = None
        self.device = self.runner.device
        self.top_k = fused_top_k(self.device)  # the proposal's log-softmax + top-k as one kernel (CUDA)
        # with the fused head: each tree level's bookkeeping as one kernel too
        self.level = level_kernel(head) if self.runner.fused_head is not None else None
        self.vocab = head.cfg.vocab_size
        self.epoch = 0  # the lease new sequences belong to (0: none)
        # each slot's pre-norm state at its last committed entry, kept by every extend: where drafting ahead
        # starts (draft_service.ahead) [slots + 1, H]
        p = head.fc.weight
        self.last_hidden = torch.zeros(slots + 1, head.cfg.hidden_size, dtype=p.dtype, device=p.device)
        self.ranks = {k: torch.tensor(tree_profile.rank_log_probs(max_steps, k), device=p.device)  # a benchmark's
                      for k in range(2, max_topk + 1)} if tree_profile is not None else {}  # [max_steps, topk]

    @property
    def step_path(self) -> str:
        """How this engine's cycles run (logged at start)."""
        r = self.runner
        if not r.padded:
            return "eagerly"
        graphs = "compiled CUDA graphs" if r.graphs.compile else "CUDA graphs" if r.graphs.enabled else "eagerly"
        return f"{'the fused head' if r.fused_head is not None else 'the padded path'}, {graphs}"

    def execute(self, ops: list[DraftOp]) -> list[DraftResult]:
        """Validate every entry, then extend and propose for all of them at once."""
        started = time.time_ns()
        results: list[DraftResult | None] = [None] * len(ops)
        work: list[Work] = []
        busy: set[int] = set()
        # where the ring sits on this engine's device, the step reads the features from it in place
        ring = self.reader.ring_on(self.device) if self.reader is not None else None
        for i, op in enumerate(ops):
            try:
                if op.seq_id in busy:
                    raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} appears twice in one step")
                if isinstance(op, ExtendPropose):
                    feats, rows = self._check_and_read(op, ring)  # within the step: reclaimed after the reply
                    seq = self.seqs.get(op.seq_id) or self._open(op)
                    if op.position == 0:  # (re)start: whatever this draft held for it is stale
                        seq.length = 0
                    busy.add(op.seq_id)
                    work.append(Work(i, op, seq, feats, rows))
                else:
                    results[i] = self._release(op)
            except OpError as e:
                gen = op.hidden.generation if isinstance(op, ExtendPropose) else 0
                results[i] = DraftResult(op.seq_id, e.code, str(e), consumed_generation=gen)
        if work:
            try:
                proposals = self.extend_and_propose(work, ring)  # its readback passes every use of the features
            except BaseException:
                if self.device.type == "cuda":  # the features read may still be in use: done before the reply
                    torch.cuda.current_stream(self.device).synchronize()
                raise
            for w, p in zip(work, proposals, strict=True):
                results[w.index] = DraftResult(w.op.seq_id, draft_ids=p.ids, draft_dists=p.dists,
                                               consumed_generation=w.op.hidden.generation, draft_parents=p.parents,
                                               ahead=p.ahead)
        ended = time.time_ns()
        for r in results:
            r.started_ns, r.ended_ns = started, ended  # type: ignore[union-attr]
        return results  # type: ignore[return-value]

    def _open(self, op: ExtendPropose) -> DraftSequence:
        if len(self.seqs) >= self.max_sequences or not self.runner.free_slots:
            raise OpError(Code.RESOURCE_EXHAUSTED, "no free draft KV slot")
        gen = torch.Generator(device=self.device).manual_seed((op.sampling.seed ^ _DRAFT_SEED_SALT) & (2**63 - 1))
        seq = DraftSequence(self.runner.allocate(), 0, op.sampling, gen, self.epoch)
        self.seqs[op.seq_id] = seq
        return seq

    def _check_and_read(self, op: ExtendPropose, ring: torch.Tensor | None
                        ) -> tuple[torch.Tensor | None, list[int] | None]:
        """Check the entry; its features [rows, 3H] read, or with `ring` (and no inline rows) the
        ring rows that hold them."""
        if self.reader is None:
            raise OpError(Code.INVALID_ARGUMENT, "no hidden-state store attached")
        if len(op.earlier) > MAX_EARLIER:
            raise OpError(Code.INVALID_ARGUMENT, f"{len(op.earlier)} earlier feature references exceed {MAX_EARLIER}")
        refs = [*op.earlier, op.hidden] if op.earlier else [op.hidden]
        rows = sum(r.rows for r in refs) if op.earlier else op.hidden.rows
        if rows != len(op.tokens) or (rows == 0 and not op.ahead) or (op.earlier and any(r.rows == 0 for r in refs)):
            raise OpError(Code.INVALID_ARGUMENT, f"{len(op.tokens)} tokens for {rows} feature rows")
        if op.num_steps > self.max_steps:
            raise OpError(Code.INVALID_ARGUMENT, f"num_steps {op.num_steps} exceeds the limit {self.max_steps}")
        if min(op.tokens + op.ahead) < 0 or max(op.tokens + op.ahead) >= self.vocab:
            raise OpError(Code.INVALID_ARGUMENT, "token id outside the vocabulary")
        if op.ahead:
            check_ahead(op, self.seqs.get(op.seq_id), self.max_steps, self.max_steps * self.max_topk)
            if not op.tokens:
                return None, []
        if not 1 <= op.topk <= self.max_topk:
            raise OpError(Code.INVALID_ARGUMENT, f"topk {op.topk} is outside 1..{self.max_topk}")
        if op.topk > 1 and op.num_steps > 0:
            if not op.sampling.greedy:
                raise OpError(Code.INVALID_ARGUMENT, "a tree (topk > 1) is drafted for greedy sequences only")
            if op.num_draft_tokens < 2:  # above every candidate: all are kept
                raise OpError(Code.INVALID_ARGUMENT, f"num_draft_tokens {op.num_draft_tokens} is outside 2.. (a tree)")
        seq = self.seqs.get(op.seq_id)
        length = 0 if seq is None else seq.length
        if op.position not in (0, length):
            raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} is at position {length} in the draft, "
                                                 f"the extend starts at {op.position}")
        if op.position + rows > self.max_context:
            raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} would exceed the draft context")
        if ring is not None and not (op.hidden.inline or (op.earlier and any(r.inline for r in refs))):
            if any(r.offset < 0 or r.offset + r.rows > ring.shape[0] for r in refs):
                raise OpError(Code.INVALID_ARGUMENT, "bad hidden-state reference: outside the ring")
            return None, [i for r in refs for i in range(r.offset, r.offset + r.rows)]
        try:
            parts = [self.reader.read(r.offset, r.rows, r.inline).to(self.device) for r in refs]
            return (parts[0] if len(parts) == 1 else torch.cat(parts)), None  # [rows, 3H]
        except ValueError as e:
            raise OpError(Code.INVALID_ARGUMENT, f"bad hidden-state reference: {e}") from e

    def extend_and_propose(self, work: list[Work], ring: torch.Tensor | None) -> list[Proposal]:
        """Extend each entry's sequence by its tokens and propose from it (`ring`: where its
        features are read from, for entries with ring rows); those drafting ahead apart."""
        out = [Proposal() for _ in work]
        if any(w.op.ahead for w in work):
            rest = [i for i, w in enumerate(work) if not w.op.ahead]
            for i, p in zip(rest, self.extend_and_propose([work[i] for i in rest], ring) if rest else [], strict=True):
                out[i] = p
            ahead = [i for i, w in enumerate(work) if w.op.ahead]
            draft_ahead(self, [work[i] for i in ahead], ring, [out[i] for i in ahead])
            return out
        shapes = {i: w.greedy_shape for i, w in enumerate(work) if w.greedy_shape is not None}
        sampled = [i for i, w in enumerate(work) if w.op.num_steps > 0 and not w.seq.sampling.greedy]
        rows = [Row(w.seq.slot, w.seq.length, w.op.tokens) for w in work]
        for w in work:
            w.seq.length += len(w.op.tokens)
        ends = [r.start + len(r.tokens) for r in rows]  # committed entries after the extend
        one_graph = (self.runner.padded and shapes and not sampled and len({s[0] for s in shapes.values()}) == 1
                     and max(len(r.tokens) for r in rows) <= self.max_steps + 1)
        if one_graph:
            grown = self._extend_and_grow(rows, work, shapes, ring)
        else:
            extended = self.runner.run(Step(rows, hidden=[w.read(ring) for w in work]))
            last_logits = torch.stack([logits[-1] for logits, _ in extended])  # [n, Vd]
            hidden = torch.stack([prenorm[-1] for _, prenorm in extended if prenorm is not None])  # [n, H]
            keep_last(self, hidden, [r.slot for r in rows])
            if sampled:
                self._sampled_chains([work[i] for i in sampled], last_logits[sampled], hidden[sampled],
                                     [ends[i] for i in sampled], [out[i] for i in sampled])
            grown = self.grow(shapes, last_logits, hidden, ends, [r.slot for r in rows]) if shapes else {}
        for i, (ids, parents) in grown.items():
            out[i].ids = ids
            if shapes[i][0] > 1:  # a chain is sent without its parents
                out[i].parents = parents
        return out

    def _extend_and_grow(self, rows: list[Row], work: list[Work], shapes: dict[int, tuple[int, int, int]],
                         ring: torch.Tensor | None) -> dict[int, tuple[list[int], list[int]]]:
        """Extend and grow as one function of one graph key (the extends padded to T, the
        extend_bucket of the longest: fewer graphs to capture): the batch's integers go to the
        device in one copy ([B, 2T + 3]: tokens, positions, slot, last row, committed entries
        after the extend; with `ring` and every entry's rows in it, [B, 3T + 3]: then each token's
        ring row, the graph gathering the features itself) and the proposals come back in one
        read."""
        r = self.runner
        b, t = r.batch_bucket(len(rows)), extend_bucket(max(len(row.tokens) for row in rows))
        topk = next(iter(shapes.values()))[0]
        steps = max(shape[1] for shape in shapes.values())
        pad = [Row(r.pad_slot, 0, [])] * (b - len(rows))
        ends = [row.start + len(row.tokens) for row in rows] + [t] * len(pad)
        ctx = self._views(b * max(t, topk), draft_cycle_entries(max(row.start for row in rows),
                                                                  max(len(row.tokens) for row in rows),
                                                                  max(ends[: len(rows)]), steps, topk))
        gather = ring is not None and all(w.rows is not None for w in work)
        at = [w.rows or [] for w in work] + [[]] * len(pad) if gather else [None] * b  # each token's ring row
        ints = np.array([[*row.tokens, *[0] * (t - len(row.tokens)), *range(row.start, row.start + t), row.slot,
                          max(len(row.tokens) - 1, 0), end, *([] if ring_rows is None else
                                                             [*ring_rows, *[0] * (t - len(ring_rows))])]
                         for row, end, ring_rows in zip([*rows, *pad], ends, at, strict=True)])
        inputs: dict[str, np.ndarray | torch.Tensor] = {"ints": ints}
        if gather:
            assert ring is not None
            width, source = ring.shape[-1], ("ring", ring.data_ptr())
        else:
            inputs["feats"] = padded_rows([w.read(ring) for w in work], b, t)
            width, source = inputs["feats"].shape[-1], None

        def fn(ints: torch.Tensor, feats: torch.Tensor | None = None) -> tuple[torch.Tensor]:
            positions, slots, last, lengths = ints[:, t : 2 * t], ints[:, 2 * t], ints[:, 2 * t + 1], ints[:, 2 * t + 2]
            if feats is None:  # the step's rows of the ring (padding: row 0, which only padding reads)
                assert ring is not None
                feats = ring[ints[:, 2 * t + 3 :]]  # [B, T, 3H]
            logits, prenorm = r.padded_forward(ints[:, :t], positions, slots, positions, ctx, hidden=feats)
            rows_ = torch.arange(b, device=feats.device)
            self.last_hidden[slots] = prenorm[rows_, last]  # (padding rows: the padding slot's)
            return self._grow_fn(logits[rows_, last], prenorm[rows_, last], lengths, slots, topk, steps, ctx)

        (packed,) = r.graphed(("extend+grow", b, t, width, topk, steps, ctx, source), fn, **inputs)
        assert packed is not None
        return unpack_trees(packed, shapes, topk)

    def grow(self, shapes: dict[int, tuple[int, int, int]], logits: torch.Tensor, hidden: torch.Tensor,
              ends: list[int], slots: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        """The greedy rows' proposals grown on the device: one graph per topk for the whole
        batch, padded to its bucket (rows of other topks and padding rows grow too; their extra
        KV entries are overwritten by their next extend). logits [n, Vd], hidden [n, H]."""
        r, n = self.runner, logits.shape[0]
        b = r.batch_bucket(n)
        logits = torch.cat([logits, logits.new_zeros(b - n, logits.shape[-1])])  # [B, Vd]
        hidden = torch.cat([hidden, hidden.new_zeros(b - n, hidden.shape[-1])])  # [B, H]
        lengths = torch.tensor(ends + [0] * (b - n), device=self.device)
        slots_t = torch.tensor(slots + [r.pad_slot] * (b - n), device=self.device)
        grown: dict[int, tuple[list[int], list[int]]] = {}
        for topk in sorted({shape[0] for shape in shapes.values()}):
            steps = max(shape[1] for shape in shapes.values() if shape[0] == topk)
            ctx = self._views(b * topk, max(ends) + (steps - 1) * topk)

            def fn(logits: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                   topk: int = topk, steps: int = steps, ctx: int = ctx) -> tuple[torch.Tensor]:
                return self._grow_fn(logits, hidden, lengths, slots, topk, steps, ctx)

            (packed,) = r.graphed(("grow", b, topk, steps, ctx), fn, logits=logits, hidden=hidden, lengths=lengths,
                                  slots=slots_t)
            assert packed is not None
            grown.update(unpack_trees(packed, shapes, topk))
        return grown

    def _views(self, rows: int, entries: int) -> int:
        """The width of a cycle's views of the KV entries (its tree nodes' visibility) for a
        batch's `rows` tokens a forward and `entries` spanned: with the fused head and level
        kernel, whose costs do not grow with it, the cache's whole length (one graph for every
        context length); else the context bucket."""
        r = self.runner
        if self.level is not None and r.fused_head is not None and rows <= r.fused_head.max_rows:
            return r.cache.max_len
        return r.ctx_bucket(entries)

    def _grow_fn(self, logits: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                 topk: int, steps: int, ctx: int) -> tuple[torch.Tensor]:
        def forward(tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    ctx: int, entries: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits, prenorm = self.runner.padded_forward(tokens, positions, slots, entries, ctx, visible=visible,
                                                         hidden=hidden)
            assert prenorm is not None
            return logits, prenorm

        grown = grow_trees(forward, self.head.to_target_ids, logits, hidden, lengths, slots, topk, steps, ctx,
                           self.top_k, self.level, self.ranks.get(topk))
        return (torch.cat(grown, dim=1),)  # one copy to the host

    def _sampled_chains(self, work: list[Work], logits: torch.Tensor, hidden: torch.Tensor, ends: list[int],
                        out: list[Proposal]) -> None:
        """Sampled chains: each step draws every live chain's token on the host (with its q),
        then runs one model step for all of them. logits [n, Vd], hidden [n, H] after the extend
        (this function's own copies: overwritten step by step)."""
        live = list(range(len(work)))
        for step in range(max(w.op.num_steps for w in work)):
            tokens = {j: self._sample(work[j].seq, logits[j], out[j]) for j in live}
            live = [j for j in live if work[j].op.num_steps > step + 1]
            if not live:
                break
            rows = [Row(work[j].seq.slot, ends[j] + step, [tokens[j]]) for j in live]
            stepped = self.runner.run(Step(rows, hidden=[hidden[j][None] for j in live]))
            for j, (step_logits, prenorm) in zip(live, stepped, strict=True):
                assert prenorm is not None
                logits[j], hidden[j] = step_logits[0], prenorm[0]

    def _sample(self, seq: DraftSequence, logits: torch.Tensor, out: Proposal) -> int:
        """Draw one draft token from draft-vocab logits [Vd]; record its target id and q."""
        q = probs_from_logits(logits[None], seq.sampling)[0]  # [Vd]
        draft_id = sample(q, seq.generator)
        nz = torch.nonzero(q).flatten()
        out.dists.append((self.head.to_target_ids(nz).tolist(), q[nz].tolist()))
        token = int(self.head.to_target_ids(torch.tensor(draft_id, device=self.device)))
        out.ids.append(token)
        return token

    def hold(self, epoch: int) -> int:
        """Serve the lease `epoch` (0: none) from now on: every sequence opened under another is
        released. Returns how many."""
        gone = [seq_id for seq_id, seq in self.seqs.items() if seq.epoch != epoch]
        for seq_id in gone:
            self.runner.release(self.seqs.pop(seq_id).slot)
        self.epoch = epoch
        return len(gone)

    def _release(self, op: Release) -> DraftResult:
        seq = self.seqs.pop(op.seq_id, None)
        if seq is not None:
            self.runner.release(seq.slot)
        return DraftResult(op.seq_id)
