"""The draft engine: extend (accepted tokens + their target features) then propose a chain
of k tokens or a tree k levels deep (draft_service/tree.py).

Draft position p pairs the token at p+1 with the target's features of position p, so
after every extend the draft holds exactly as many positions as the target's cache.
Proposal steps past that write speculative KV entries that the next extend overwrites.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draft_service.tree import DraftTree, grow_trees_static, static_tree_result
from specsplit.handoff.base import HiddenReader
from specsplit.models.cuda_graphs import GraphCache, bucket_up, compile_static, pow2_buckets
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.layers import Segment
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
    def __init__(self, head: Eagle3Head, max_sequences: int, max_context: int, max_steps: int,
                 cuda_graphs: bool = True, compile: bool = False, max_topk: int = 8) -> None:
        self.head, self.max_steps, self.max_context, self.max_topk = head, max_steps, max_context, max_topk
        self.compiled = compile
        self.static_fn = compile_static(head.static_forward) if compile else head.static_forward
        # a spare slot for the padding rows of static batches; room for padded extends, chains and trees
        self.pad_slot = max_sequences
        self.cache = head.new_cache(max_sequences + 1, max_context + 2 * max_steps + 2 + max_steps * max_topk)
        self.free_slots = list(range(max_sequences - 1, -1, -1))
        self.seqs: dict[int, DraftSequence] = {}
        self.reader: HiddenReader | None = None
        self.device = head.fc.weight.device
        self.vocab = head.cfg.vocab_size
        self.graphs = GraphCache(self.device, cuda_graphs)
        # padded static batches on CUDA, with or without graphs (the same kernels either way); tests turn them on on CPU
        self.use_static = self.device.type == "cuda"
        self.batch_buckets = pow2_buckets(1, max_sequences)
        self.ctx_buckets = pow2_buckets(min(128, self.cache.max_len), self.cache.max_len)

    def execute(self, ops: list[DraftOp]) -> list[DraftResult]:
        """Validate every entry, extend all sequences in one forward, then propose step by
        step with every still-proposing sequence batched into each step's forward."""
        started = time.time_ns()
        results: list[DraftResult | None] = [None] * len(ops)
        work: list[tuple[int, ExtendPropose, DraftSequence, torch.Tensor]] = []
        busy: set[int] = set()
        for i, op in enumerate(ops):
            try:
                if op.seq_id in busy:
                    raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} appears twice in one step")
                if isinstance(op, ExtendPropose):
                    feats = self._check_and_read(op)  # read now: the rows are reclaimed after the reply
                    seq = self.seqs.get(op.seq_id) or self._open(op)
                    if op.position == 0:  # (re)start: whatever this draft held for it is stale
                        seq.length = 0
                    busy.add(op.seq_id)
                    work.append((i, op, seq, feats))
                else:
                    results[i] = self._release(op)
            except OpError as e:
                gen = op.hidden.generation if isinstance(op, ExtendPropose) else 0
                results[i] = DraftResult(op.seq_id, e.code, str(e), consumed_generation=gen)
        if work:
            for (i, op, _, _), (ids, dists, parents) in zip(work, self._extend_and_propose(work), strict=True):
                results[i] = DraftResult(op.seq_id, draft_ids=ids, draft_dists=dists,
                                         consumed_generation=op.hidden.generation, draft_parents=parents)
        ended = time.time_ns()
        for r in results:
            assert r is not None
            r.started_ns, r.ended_ns = started, ended
        return results  # type: ignore[return-value]

    def _open(self, op: ExtendPropose) -> DraftSequence:
        if not self.free_slots:
            raise OpError(Code.RESOURCE_EXHAUSTED, "no free draft KV slot")
        gen = torch.Generator(device=self.device).manual_seed((op.sampling.seed ^ _DRAFT_SEED_SALT) & (2**63 - 1))
        seq = DraftSequence(self.free_slots.pop(), 0, op.sampling, gen)
        self.seqs[op.seq_id] = seq
        return seq

    def _check_and_read(self, op: ExtendPropose) -> torch.Tensor:
        if self.reader is None:
            raise OpError(Code.INVALID_ARGUMENT, "no hidden-state store attached")
        rows = op.hidden.rows
        if rows != len(op.tokens) or rows == 0:
            raise OpError(Code.INVALID_ARGUMENT, f"{len(op.tokens)} tokens for {rows} feature rows")
        if op.num_steps > self.max_steps:
            raise OpError(Code.INVALID_ARGUMENT, f"num_steps {op.num_steps} exceeds the limit {self.max_steps}")
        if any(not 0 <= t < self.vocab for t in op.tokens):
            raise OpError(Code.INVALID_ARGUMENT, "token id outside the vocabulary")
        if not 1 <= op.topk <= self.max_topk:
            raise OpError(Code.INVALID_ARGUMENT, f"topk {op.topk} is outside 1..{self.max_topk}")
        if op.topk > 1 and op.num_steps > 0:
            if not op.sampling.greedy:
                raise OpError(Code.INVALID_ARGUMENT, "a tree (topk > 1) is drafted for greedy sequences only")
            if op.num_draft_tokens < 2:  # above every candidate: all are kept
                raise OpError(Code.INVALID_ARGUMENT, f"num_draft_tokens {op.num_draft_tokens} is outside 2.. "
                                                     "for a tree")
        seq = self.seqs.get(op.seq_id)
        length = 0 if seq is None else seq.length
        if op.position not in (0, length):
            raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} is at position {length} in the draft, "
                                                 f"the extend starts at {op.position}")
        if op.position + rows > self.max_context:
            raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} would exceed the draft context")
        try:
            return self.reader.read(op.hidden.offset, rows, op.hidden.inline).to(self.device)  # [rows, 3H]
        except ValueError as e:
            raise OpError(Code.INVALID_ARGUMENT, f"bad hidden-state reference: {e}") from e

    def _extend_and_propose(self, work: list[tuple[int, ExtendPropose, DraftSequence, torch.Tensor]]
                            ) -> list[tuple[list[int], list[SparseDist], list[int]]]:
        if self.use_static and max(len(op.tokens) for _, op, _, _ in work) <= self.max_steps + 1:
            return self._propose_static(work)  # cycles' extends; prompt-length extends run eagerly
        trees = {b: DraftTree(seq.slot, seq.length + len(op.tokens), op.topk, op.num_draft_tokens - 1)
                 for b, (_, op, seq, _) in enumerate(work) if op.topk > 1 and op.num_steps > 0}
        tokens = torch.tensor([t for _, op, _, _ in work for t in op.tokens], dtype=torch.long, device=self.device)
        feats = torch.cat([f for _, _, _, f in work])
        segments = [Segment(seq.slot, seq.length, len(op.tokens)) for _, op, seq, _ in work]
        logits, prenorm = self.head.forward_batch(tokens, feats, segments, self.cache)  # [N, Vd], [N, H]
        ends = torch.tensor([len(op.tokens) for _, op, _, _ in work], device=self.device).cumsum(0) - 1
        last_logits, hidden = logits[ends], prenorm[ends]  # [B, Vd], [B, H]
        for _, op, seq, _ in work:
            seq.length += len(op.tokens)
        out: list[tuple[list[int], list[SparseDist], list[int]]] = [([], [], []) for _ in work]
        if trees:
            rows = list(trees)
            self._grow_trees(trees, {b: work[b][1].num_steps for b in rows}, last_logits[rows], hidden[rows])
            for b, tree in trees.items():
                ids, parents = tree.result()
                out[b][0].extend(ids)
                out[b][2].extend(parents)
        active = [b for b in range(len(work)) if b not in trees]  # rows of last_logits / hidden, in this order
        last_logits, hidden = last_logits[active], hidden[active]
        step = 0
        while active:
            keep = [j for j, b in enumerate(active) if work[b][1].num_steps > step]
            active, last_logits, hidden = [active[j] for j in keep], last_logits[keep], hidden[keep]
            next_tokens = [self._choose(work[b][2], last_logits[j], out[b][:2]) for j, b in enumerate(active)]
            more = [j for j, b in enumerate(active) if work[b][1].num_steps > step + 1]
            if not more:
                break
            # the next step reads each sequence's own pre-norm state, not target features
            segs = [Segment(work[active[j]][2].slot, work[active[j]][2].length + step, 1) for j in more]
            toks = torch.tensor([next_tokens[j] for j in more], dtype=torch.long, device=self.device)
            last_logits, hidden = self.head.forward_batch(toks, hidden[more], segs, self.cache)
            active = [active[j] for j in more]
            step += 1
        return out

    def _grow_trees(self, trees: dict[int, DraftTree], steps: dict[int, int], logits: torch.Tensor,
                    hidden: torch.Tensor) -> None:
        """Grow every tree level by level, all trees' frontiers in one forward per level.
        logits [T, Vd], hidden [T, H]: each tree's sequence after its extend, in `trees` order."""
        order = list(trees)
        widest = max(tree.topk for tree in trees.values())
        inputs: dict[int, torch.Tensor] = {}  # tree -> the hidden input of each frontier node [n, H]
        top_ids, top_lp = self._top(logits, widest)
        for j, b in enumerate(order):
            tree = trees[b]
            tree.add(-1, top_ids[j][: tree.topk], top_lp[j][: tree.topk])
            tree.choose_frontier(0)
            inputs[b] = hidden[j].expand(len(tree.frontier), -1)
        for depth in range(1, max(steps.values())):
            live = [b for b in order if steps[b] > depth]
            segments = [trees[b].frontier_segment(self.device) for b in live]
            tokens = torch.tensor([trees[b].tokens[i] for b in live for i in trees[b].frontier], dtype=torch.long,
                                  device=self.device)
            logits, prenorm = self.head.forward_batch(tokens, torch.cat([inputs[b] for b in live]), segments,
                                                      self.cache)  # [N, Vd], [N, H]
            top_ids, top_lp = self._top(logits, widest)
            row = 0
            for b in live:
                tree, first = trees[b], len(trees[b].tokens)
                rows = {}
                for node in tree.frontier:
                    tree.add(node, top_ids[row][: tree.topk], top_lp[row][: tree.topk])
                    rows[node], row = row, row + 1
                tree.choose_frontier(first)
                parent_rows = torch.tensor([rows[tree.parents[i]] for i in tree.frontier], device=self.device)
                inputs[b] = prenorm[parent_rows]

    def _top(self, logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """The k most likely draft tokens of each row of logits [N, Vd], as target ids, with
        their log-probabilities."""
        top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return self.head.to_target_ids(top.indices).tolist(), top.values.tolist()

    def _propose_static(self, work: list[tuple[int, ExtendPropose, DraftSequence, torch.Tensor]]
                        ) -> list[tuple[list[int], list[SparseDist], list[int]]]:
        """The same extend and proposal as a padded static batch. When every proposing row is
        greedy with one topk (the usual cycle), the extend and all steps of the greedy chains
        (trees of topk 1) or trees run as ONE function (one CUDA graph: _extend_and_grow) fed by
        one host copy of the batch's integers and read back once. Otherwise one extend forward,
        then each topk's trees in one function (grow_trees_static), and sampled chains choosing
        each token on the host, one forward per step for the whole batch. Every row runs its
        group's deepest proposal and keeps its own; the extra steps write KV entries that the
        next extend overwrites."""
        n = len(work)
        b = bucket_up(n, self.batch_buckets)
        t = max(len(op.tokens) for _, op, _, _ in work)
        assert b is not None
        pad = b - n
        tokens = [[*op.tokens, *[0] * (t - len(op.tokens))] for _, op, _, _ in work] + [[0] * t] * pad  # [B, T]
        positions = [list(range(seq.length, seq.length + t)) for _, _, seq, _ in work] + [list(range(t))] * pad
        slots = [seq.slot for _, _, seq, _ in work] + [self.pad_slot] * pad
        last = [len(op.tokens) - 1 for _, op, _, _ in work] + [0] * pad
        ends = [seq.length + len(op.tokens) for _, op, seq, _ in work] + [t] * pad  # committed entries after the extend
        feats = self._static_features(work, b, t)  # [B, T, 3H]
        for _, op, seq, _ in work:
            seq.length += len(op.tokens)
        out: list[tuple[list[int], list[SparseDist], list[int]]] = [([], [], []) for _ in work]
        shapes = {i: (op.topk, op.num_steps, op.num_draft_tokens - 1 if op.topk > 1 else op.num_steps)
                  for i, (_, op, seq, _) in enumerate(work) if op.num_steps > 0 and seq.sampling.greedy}
        sampled = [i for i, (_, op, seq, _) in enumerate(work) if op.num_steps > 0 and not seq.sampling.greedy]
        if shapes and not sampled and len({shape[0] for shape in shapes.values()}) == 1:
            grown = self._extend_and_grow(shapes, tokens, positions, slots, last, ends, feats)
        else:
            dev = self.device
            slots_t, ends_t = torch.tensor(slots, device=dev), torch.tensor(ends)
            logits, prenorm = self._static_forward(torch.tensor(tokens), feats, torch.tensor(positions), slots_t,
                                                   max(p[-1] for p in positions) + 1)
            rows, last_t = torch.arange(b, device=dev), torch.tensor(last, device=dev)
            last_logits, hidden = logits[rows, last_t], prenorm[rows, last_t]  # [B, Vd], [B, H]
            if sampled:
                grow_from = (last_logits.clone(), hidden.clone()) if shapes else None  # the steps replay graphs
                self._sampled_chains(work, sampled, out, last_logits, hidden, ends_t, slots_t)
                if grow_from is not None:
                    last_logits, hidden = grow_from
            grown = self._grow_static(shapes, last_logits, hidden, ends_t, slots_t)
        for i, (ids, parents) in grown.items():
            out[i][0].extend(ids)
            if shapes[i][0] > 1:  # a chain is sent without its parents
                out[i][2].extend(parents)
        return out

    def _static_features(self, work: list[tuple[int, ExtendPropose, DraftSequence, torch.Tensor]], b: int, t: int
                         ) -> torch.Tensor:
        """The extend's target features as [B, T, 3H]: a view when one sequence fills the batch."""
        if b == 1 and len(work[0][1].tokens) == t:
            return work[0][3][None].to(self.head.fc.weight.dtype)
        width = work[0][3].shape[-1]
        feats = torch.zeros(b, t, width, dtype=self.head.fc.weight.dtype, device=self.device)
        for i, (_, op, _, f) in enumerate(work):
            feats[i, : len(op.tokens)] = f
        return feats

    def _extend_and_grow(self, shapes: dict[int, tuple[int, int, int]], tokens: list[list[int]],
                         positions: list[list[int]], slots: list[int], last: list[int], ends: list[int],
                         feats: torch.Tensor) -> dict[int, tuple[list[int], list[int]]]:
        """Extend and grow in one function of one graph key: the batch's integers go to the
        device in one copy ([B, 2T + 3]: tokens, positions, slot, last row, length) and the
        proposals come back in one read."""
        b, t = len(tokens), len(tokens[0])
        topk = next(iter(shapes.values()))[0]
        steps = max(shape[1] for shape in shapes.values())
        # the extend's entries (padding tokens included) and every level's
        ctx = bucket_up(max(max(p[-1] for p in positions) + 1, max(ends) + (steps - 1) * topk), self.ctx_buckets)
        assert ctx is not None
        ints = torch.tensor([[*tokens[i], *positions[i], slots[i], last[i], ends[i]] for i in range(b)])

        def fn(ints: torch.Tensor, feats: torch.Tensor) -> tuple:
            slots, last, lengths = ints[:, 2 * t], ints[:, 2 * t + 1], ints[:, 2 * t + 2]
            logits, prenorm = self.static_fn(ints[:, :t], feats, ints[:, t : 2 * t], slots, ctx, self.cache)
            rows = torch.arange(b, device=feats.device)
            return self._grow_fn(logits[rows, last], prenorm[rows, last], lengths, slots, topk, steps, ctx)

        with torch.no_grad() if self.compiled else torch.inference_mode():
            (packed,) = self.graphs.run(("extend+grow", b, t, feats.shape[-1], topk, steps, ctx), fn, ints=ints,
                                        feats=feats)
        assert packed is not None
        return self._unpack(packed, shapes, topk)

    def _grow_fn(self, logits: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                 topk: int, steps: int, ctx: int) -> tuple[torch.Tensor]:
        def forward(*args: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.static_fn(*args[:5], self.cache, *args[5:])

        return (torch.cat(grow_trees_static(forward, self.head.to_target_ids, logits, hidden, lengths, slots, topk,
                                            steps, ctx), dim=1),)  # one copy to the host

    @staticmethod
    def _unpack(packed: torch.Tensor, shapes: dict[int, tuple[int, int, int]], topk: int
                ) -> dict[int, tuple[list[int], list[int]]]:
        """The rows of `shapes` with this topk, from grow_trees_static's [B, 3N] (target ids,
        parents, best-first order), each cut to its own steps and size."""
        host = packed.tolist()
        per = packed.shape[1] // 3
        return {i: static_tree_result(host[i][:per], host[i][per : 2 * per], host[i][2 * per :], topk, shape[1],
                                      shape[2])
                for i, shape in shapes.items() if shape[0] == topk}

    def _sampled_chains(self, work: list[tuple[int, ExtendPropose, DraftSequence, torch.Tensor]], sampled: list[int],
                        out: list[tuple[list[int], list[SparseDist], list[int]]], last_logits: torch.Tensor,
                        hidden: torch.Tensor, ends: torch.Tensor, slots: torch.Tensor) -> None:
        """The sampled rows' chains: each step's tokens drawn on the host, with their q."""
        steps = max(work[i][1].num_steps for i in sampled)
        chosen = torch.zeros(last_logits.shape[0], steps, dtype=torch.long, device=self.device)  # [B, steps]
        for step in range(steps):
            for i in sampled:
                if work[i][1].num_steps > step:
                    chosen[i, step] = self._choose(work[i][2], last_logits[i], (out[i][0], out[i][1]))
            if step + 1 < steps:
                pos = (ends + step)[:, None]  # [B, 1]
                logits, prenorm = self._static_forward(chosen[:, step : step + 1], hidden[:, None], pos, slots,
                                                       int(pos.max()) + 1)
                last_logits, hidden = logits[:, 0], prenorm[:, 0]

    def _grow_static(self, shapes: dict[int, tuple[int, int, int]], logits: torch.Tensor, hidden: torch.Tensor,
                     ends: torch.Tensor, slots: torch.Tensor) -> dict[int, tuple[list[int], list[int]]]:
        """The rows' proposals grown on the device, shapes[row] = (topk, num_steps, tokens to
        keep): one graph per topk for the whole padded batch (the other rows' extra KV entries
        are overwritten by their next extend). logits [B, Vd], hidden [B, H], ends [B] each
        row's committed draft entries (host)."""
        grown: dict[int, tuple[list[int], list[int]]] = {}
        b = logits.shape[0]
        lengths = ends.to(self.device)
        for topk in sorted({shape[0] for shape in shapes.values()}):
            steps = max(shape[1] for shape in shapes.values() if shape[0] == topk)
            ctx = bucket_up(int(ends.max()) + (steps - 1) * topk, self.ctx_buckets)
            assert ctx is not None

            def fn(logits: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                   topk: int = topk, steps: int = steps, ctx: int = ctx) -> tuple:
                return self._grow_fn(logits, hidden, lengths, slots, topk, steps, ctx)

            with torch.no_grad() if self.compiled else torch.inference_mode():
                (packed,) = self.graphs.run(("grow", b, topk, steps, ctx), fn, logits=logits, hidden=hidden,
                                            lengths=lengths, slots=slots)
            assert packed is not None
            grown.update(self._unpack(packed, shapes, topk))
        return grown

    def _static_forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [B, T], hidden [B, T, 3H or H] -> logits [B, T, Vd], prenorm [B, T, H]."""
        ctx = bucket_up(needed, self.ctx_buckets)
        assert ctx is not None
        b, t = tokens.shape

        def fn(tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> tuple:
            return self.static_fn(tokens, hidden, positions, slots, ctx, self.cache)

        with torch.no_grad() if self.compiled else torch.inference_mode():
            logits, prenorm = self.graphs.run((b, t, hidden.shape[-1], ctx), fn, tokens=tokens, hidden=hidden,
                                              positions=positions, slots=slots)  # host tensors: one copy each
        assert logits is not None and prenorm is not None
        return logits, prenorm

    def _choose(self, seq: DraftSequence, logits: torch.Tensor, out: tuple[list[int], list[SparseDist]]) -> int:
        """Pick one draft token from draft-vocab logits [Vd]; record its target id (and q)."""
        if seq.sampling.greedy:
            draft_id = int(torch.argmax(logits))
        else:
            q = probs_from_logits(logits[None], seq.sampling)[0]  # [Vd]
            draft_id = sample(q, seq.generator)
            nz = torch.nonzero(q).flatten()
            out[1].append((self.head.to_target_ids(nz).tolist(), q[nz].tolist()))
        token = int(self.head.to_target_ids(torch.tensor(draft_id, device=self.device)))
        out[0].append(token)
        return token

    def _release(self, op: Release) -> DraftResult:
        seq = self.seqs.pop(op.seq_id, None)
        if seq is not None:
            self.free_slots.append(seq.slot)
        return DraftResult(op.seq_id)
