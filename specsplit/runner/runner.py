"""One runner per engine, the same class for the target and the draft (nano-vllm's model runner).

The engine says what to compute: a `Step` of rows, each one sequence's new tokens. The runner
says how. It owns the model's KV cache and slots, the shape buckets and padding, the CUDA
graphs, and the execution path of each step:

- fused: the rows as fused kernels (a `FusedLlama`), padded to (batch bucket, longest row) up to
  its row limit, from a graph per shape;
- padded: the rows padded to (batch bucket, longest row, context bucket), from a graph per shape
  (on CUDA; eagerly on the same shapes without graphs, with identical results);
- eager: ragged, each row as long as it is (long rows, CPU serving).

Rows from entry 0 (prompts, recomputed sequences) run apart, a forward per length bucket
(specsplit.runner.prompts), and so do continuing rows too long for the fused and padded paths
(the parts of a prompt prefilled in parts): the others keep their fast path.

On the CPU in fp32 the runner packs the model's projection weights for oneDNN once
(specsplit.models.parallel.pack_for_cpu), unless it compiles the model.

Engines with computations of their own between model steps (the draft's tree growth) build
them from `padded_forward` and capture them with `graphed`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from specsplit.models.batch import Batch, Segment, tree_segment
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.fused import FusedLlama
from specsplit.models.fused_head import FusedHead
from specsplit.models.layers import KVCache
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import pack_for_cpu
from specsplit.runner.acceptance import verify_rows
from specsplit.runner.decoding import decode
from specsplit.runner.graphs import (
    GraphCache,
    HostInput,
    Outputs,
    batch_buckets,
    bucket_up,
    compile_static,
    pow2_buckets,
)
from specsplit.runner.outputs import RowOutput, RowOutputs, Verified, accepted_row, row_outputs
from specsplit.runner.packing import Row, pack_rows, padded_rows
from specsplit.runner.prompts import run_prompts

Model = LlamaModel | Eagle3Head  # logits with captured features, or with pre-norm states
T = TypeVar("T")


@dataclass
class Step:
    rows: list[Row]
    capture: bool = False  # the target: also the capture layers' outputs
    hidden: list[torch.Tensor] | None = None  # the head: each row's hidden input [len(tokens), W]


class ModelRunner:
    def __init__(self, model: Model, slots: int, max_len: int, *, cuda_graphs: bool = True,
                 compile: bool = False, compile_graphs: bool = False, fused: FusedLlama | None = None,
                 fused_head: FusedHead | None = None, padded_tokens: int = 0,
                 row_bucket: Callable[[int], int] | None = None) -> None:
        """`slots` sequences of up to `max_len` KV entries each; rows of up to `padded_tokens`
        tokens run padded on CUDA, to the longest row (or its `row_bucket`: fewer graphs); `fused`
        (a FusedLlama) takes the steps whose padded rows fit it; `fused_head` (a FusedHead) the
        head's padded forwards that fit it. `compile`: the padded forward
        compiled once for all shapes; `compile_graphs`: each graphed function compiled whole for
        its shapes before capture (CUDA graphs only)."""
        self.model = model
        self.device = next(model.parameters()).device
        pack_for_cpu(model, pack=not compile)  # (inductor lowers oneDNN's packed products only in frozen graphs)
        self.cache: KVCache = model.new_cache(slots + 1, max_len)  # the extra slot takes padding rows
        self.pad_slot = slots
        self._free = list(range(slots - 1, -1, -1))
        self.graphs = GraphCache(self.device, cuda_graphs, compile=compile_graphs)
        self.padded = self.device.type == "cuda"  # steps of short rows padded (tests turn it on on the CPU)
        self.padded_tokens = padded_tokens
        self.row_bucket = row_bucket
        self.fused, self.fused_head = fused, fused_head
        # the hidden-state ring [capacity, X] a verify step writes its rows' features into itself (Row.ring_row)
        self.ring: torch.Tensor | None = None
        self.compiled = compile
        self._padded_fn = compile_static(self._padded_forward) if compile else self._padded_forward
        # batches of up to the fused step's few rows run unpadded: a few-row step costs by its rows,
        # and a batch of 3 padded to 4 would leave the few-row path for the tensor-core tiles
        self.batch_buckets = batch_buckets(slots, fused.few_rows if fused is not None else 0)
        self.ctx_buckets = pow2_buckets(min(128, max_len), max_len)

    # -- KV slots
    def allocate(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def batch_bucket(self, n: int) -> int:
        b = bucket_up(n, self.batch_buckets)
        assert b is not None, f"{n} rows exceed the {self.pad_slot} slots"
        return b

    def ctx_bucket(self, n: int) -> int:
        c = bucket_up(n, self.ctx_buckets)
        assert c is not None, f"{n} entries exceed the cache's {self.cache.max_len}"
        return c

    # -- steps
    def mode(self) -> contextlib.AbstractContextManager[object]:
        """Where every forward runs: inference mode (no_grad for compiled code, which mutates the cache in a graph)."""
        return torch.no_grad() if self.compiled else torch.inference_mode()

    def run(self, step: Step) -> Sequence[RowOutput]:
        """Each row's logits [T, V] (a row from entry 0: [1, V], its last token's) and features
        [T, X] (views of graph outputs: valid until the next step of the same shape)."""
        split = self._split(step)
        if split is not None:
            return _merged(len(step.rows), split, [self.run(_part(step, rows)) for rows in split])
        if step.rows[0].start == 0:
            return [(v.logits, v.features) for v in self._prompts(step, False)]
        return self._step(step, False)[0]

    def verify(self, step: Step) -> list[Verified]:
        """The target's step: run(step), then each row's argmax and, for rows that accept on the
        device, acceptance and the accepted path's KV entries moved into place; all in the step
        (its graph), read back to the host in one copy."""
        split = self._split(step)
        if split is not None:
            return _merged(len(step.rows), split, [self.verify(_part(step, rows)) for rows in split])
        if step.rows[0].start == 0:
            return self._prompts(step, True)
        outputs, ints = self._step(step, True)
        assert ints is not None
        host = ints.tolist()
        if ints.dim() == 1:  # eager: every row's argmax, then the accepting rows' readback
            return self._eager_verified(step, outputs, host)
        ring = self._ring_rows(step, True)  # the step wrote its rows' features into the ring
        return [Verified(outputs, i, *accepted_row(row, len(r.tokens)), ring and r.ring_row >= 0)
                for i, (r, row) in enumerate(zip(step.rows, host, strict=False))]

    def decode(self, step: Step, k: int, sampling: np.ndarray | None = None) -> list[list[int]]:
        """k tokens for each row, one step after another in one call (specsplit.runner.decoding)."""
        return decode(self, step, k, sampling)

    def _eager_verified(self, step: Step, outputs: RowOutputs, host: list[int]) -> list[Verified]:
        out = [Verified(outputs, i, [0], host[start:end]) for i, (start, end) in enumerate(outputs.logit_spans)]
        at = outputs.logit_spans[-1][1] if out else 0
        accepting = [v for r, v in zip(step.rows, out, strict=True) if r.accept]
        width = (len(host) - at) // len(accepting) if accepting else 0  # 1 + 2T
        for j, v in enumerate(accepting):
            v.path, v.best = accepted_row(host[at + j * width : at + (j + 1) * width], v.logits.shape[0])
        return out

    def _split(self, step: Step) -> tuple[list[int], ...] | None:
        """Where a step mixes rows from entry 0 (prompts, recomputed sequences: see
        specsplit.runner.prompts), continuing rows too long for the fused and padded paths (parts
        of prompts) and continuing rows short enough for one: the indices of each kind, run as
        steps of their own. A newcomer then neither takes the running sequences off their fast
        path nor changes the bits they compute."""
        short: list[int] = []
        long: list[int] = []
        fresh: list[int] = []
        for i, r in enumerate(step.rows):
            (fresh if r.start == 0 else short if self._fast(r) else long).append(i)
        parts = tuple(p for p in (short, long, fresh) if p)
        return parts if len(parts) > 1 else None

    def _fast(self, r: Row) -> bool:
        """Whether a continuing row fits the fused or the padded path (a part of a prompt never
        does: its length, and the graph its shape would need, are its own)."""
        t = len(r.tokens)
        return not r.last_only and ((self.fused is not None and self.fused.takes(1, t))
                                    or (self.padded and t <= self.padded_tokens))

    def _prompts(self, step: Step, verify: bool) -> list[Verified]:
        with self.mode():
            return run_prompts(self, step.rows, step.hidden, step.capture, verify)

    def _step(self, step: Step, verify: bool) -> tuple[RowOutputs, torch.Tensor | None]:
        """Continuing rows, on the fused path where they fit it, else padded where short enough, else
        eagerly (and parts of prompts always)."""
        t = max(len(r.tokens) for r in step.rows)
        fast = all(not r.last_only for r in step.rows)
        with self.mode():
            if fast and self.fused is not None and self.fused.takes(self.batch_bucket(len(step.rows)), t):
                return self._run_fused(step, verify)
            if fast and self.padded and t <= self.padded_tokens:
                return self._run_padded(step, verify)
            return self._run_eager(step, verify)

    def graphed(self, key: tuple[object, ...], fn: Callable[..., Outputs], **inputs: HostInput) -> Outputs:
        """fn(**inputs) from a CUDA graph of this key (captured on first use); inputs may be host
        tensors or arrays."""
        with self.mode():
            return self.graphs.run(key, fn, **inputs)

    def padded_forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       entries: torch.Tensor, ctx: int, tree_mask: torch.Tensor | None = None,
                       visible: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                       capture: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model on a padded batch (see Batch.padded): tokens, positions, entries [B, T],
        slots [B], hidden [B, T, W] -> logits [B, T, V], features [B, T, X]. Capturable."""
        return self._padded_fn(tokens, positions, slots, entries, ctx, tree_mask, visible, hidden, capture)

    def _padded_forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        entries: torch.Tensor, ctx: int, tree_mask: torch.Tensor | None,
                        visible: torch.Tensor | None, hidden: torch.Tensor | None, capture: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = tokens.shape
        batch = Batch.padded(positions, slots, entries, ctx, tree_mask, visible, capture, hidden)
        head = self.fused_head if self.fused_head is not None and self.fused_head.takes(b, t) else None
        logits, extra = (head or self.model).forward(tokens.reshape(b * t), batch, self.cache)
        return logits.view(b, t, -1), None if extra is None else extra.view(b, t, -1)

    def _ring_rows(self, step: Step, verify: bool) -> bool:
        """Whether this padded or fused step writes rows' features into the ring itself."""
        return verify and self.ring is not None and step.capture and any(r.ring_row >= 0 for r in step.rows)

    def _ring_key(self, ring: bool) -> tuple[str, int] | None:
        return ("ring", self.ring.data_ptr()) if ring and self.ring is not None else None

    def _write_ring(self, f: dict[str, torch.Tensor], features: torch.Tensor | None) -> None:
        """The rows' features (path first) into the ring, where pack_rows placed them."""
        if "ring_dst" in f:
            assert self.ring is not None and features is not None
            rows = features.reshape(-1, features.shape[-1])  # [B*T, X]
            self.ring[f["ring_dst"]] = rows[f["ring_src"]].to(self.ring.dtype)

    def _run_eager(self, step: Step, verify: bool = False) -> tuple[RowOutputs, torch.Tensor | None]:
        dev = self.device
        segments = [tree_segment(r.slot, r.start, r.parents, dev) if r.parents
                    else Segment(r.slot, r.start, len(r.tokens)) for r in step.rows]
        tokens = torch.tensor([t for r in step.rows for t in r.tokens], dtype=torch.long, device=dev)
        hidden = None if step.hidden is None else torch.cat(step.hidden).to(dev)
        batch = Batch.ragged(segments, dev, step.capture, hidden)
        spans, logit_spans, wanted = [], [], []  # each row's tokens, its logits, the tokens with logits
        for r in step.rows:
            off, at = spans[-1][1] if spans else 0, len(wanted)
            spans.append((off, off + len(r.tokens)))
            wanted += [off + len(r.tokens) - 1] if r.last_only else range(off, off + len(r.tokens))
            logit_spans.append((at, len(wanted)))
        if len(wanted) < len(tokens):
            batch.logits_at = torch.tensor(wanted, device=dev)
        logits, extra = self.model.forward(tokens, batch, self.cache)
        out = RowOutputs(logits, extra, spans, logit_spans)
        if not verify:
            return out, None
        # the verify rows padded to their longest, accepted as a padded step would; the others' argmax
        best = logits.argmax(-1)  # [N]
        rows = [i for i, r in enumerate(step.rows) if r.accept]
        if not rows:
            return out, best
        t = max(len(step.rows[i].tokens) for i in rows)
        tree = any(step.rows[i].parents for i in rows)
        packed, layout = pack_rows([step.rows[i] for i in rows], len(rows), t, tree, True)
        f = layout.unpack(torch.from_numpy(packed).to(dev))
        padded = torch.stack([torch.cat([lg, lg.new_zeros(t - lg.shape[0], lg.shape[1])]) for lg in
                              (out.row_logits(i) for i in rows)])  # [A, t, V]
        feats = None if extra is None else padded_rows([out.row_features(i) for i in rows],  # type: ignore[misc]
                                                       len(rows), t)
        ints, feats = verify_rows(padded, feats, f["fields"], f.get("mask"), self.cache, f["slots"],
                                  f["entries"][:, 0], tree)
        if feats is not None:
            for j, i in enumerate(rows):
                out.replaced[i] = feats[j, : len(step.rows[i].tokens)]
        return out, torch.cat([best, ints.flatten()])

    def _run_padded(self, step: Step, verify: bool = False) -> tuple[RowOutputs, torch.Tensor | None]:
        """The rows padded to the batch bucket, each to the longest row T, their integers in one
        host array (see pack_rows; trees: with their masks). Padding tokens write entries past
        their row that later steps overwrite; padding rows write the spare slot."""
        rows = step.rows
        b, t = self.batch_bucket(len(rows)), max(len(r.tokens) for r in rows)
        if self.row_bucket is not None:
            t = self.row_bucket(t)
        # the fused head reads no context bucket: one graph for every context length
        head = self.fused_head is not None and self.fused_head.takes(b, t)
        ctx = self.cache.max_len if head else self.ctx_bucket(max(r.start for r in rows) + t)
        tree = any(r.parents for r in rows)
        ring = self._ring_rows(step, verify)
        packed, layout = pack_rows(rows + [Row(self.pad_slot, 0, [])] * (b - len(rows)), b, t, tree, verify, ring)
        inputs: dict[str, HostInput] = {"packed": packed}
        if step.hidden is not None:
            inputs["hidden"] = padded_rows(step.hidden, b, t)

        def fn(packed: torch.Tensor, hidden: torch.Tensor | None = None) -> Outputs:
            f = layout.unpack(packed)
            logits, extra = self.padded_forward(f["tokens"], f["positions"], f["slots"], f["entries"], ctx,
                                                f.get("mask"), hidden=hidden, capture=step.capture)
            if not verify:
                return logits, extra
            ints, extra = verify_rows(logits, extra, f["fields"], f.get("mask"), self.cache, f["slots"],
                                      f["entries"][:, 0], tree)
            self._write_ring(f, extra)
            return logits, extra, ints

        width = None if step.hidden is None else step.hidden[0].shape[-1]
        key = ("padded", b, t, ctx, tree, step.capture, width, verify, self._ring_key(ring))
        got = self.graphs.run(key, fn, **inputs)
        logits, extra = got[0], got[1]
        assert logits is not None
        return row_outputs(logits.reshape(b * t, -1), None if extra is None else extra.reshape(b * t, -1), rows, t), \
            got[2] if verify else None

    def _run_fused(self, step: Step, verify: bool = False) -> tuple[RowOutputs, torch.Tensor | None]:
        """The rows padded to (batch bucket B, longest row T) as the fused step, its integers in
        one host array (see pack_rows, masks always)."""
        rows, fused = step.rows, self.fused
        assert fused is not None
        b, t = self.batch_bucket(len(rows)), max(len(r.tokens) for r in rows)
        tree = any(r.parents for r in rows)
        ring = self._ring_rows(step, verify)
        packed, layout = pack_rows(rows + [Row(self.pad_slot, 0, [])] * (b - len(rows)), b, t, True, verify, ring)

        def fn(packed: torch.Tensor) -> Outputs:
            f = layout.unpack(packed)
            batch = Batch.padded(f["positions"], f["slots"], f["entries"], 0, f["mask"], capture=step.capture)
            logits, extra = fused.forward(f["tokens"].reshape(-1), batch, self.cache)  # [B*T, V], [B*T, X]
            if not verify:
                return logits, extra
            ints, extra = verify_rows(logits.view(b, t, -1), None if extra is None else extra.view(b, t, -1),
                                      f["fields"], f["mask"], self.cache, f["slots"], f["entries"][:, 0], tree,
                                      fused=logits.is_cuda)  # the acceptance kernel: Triton on CUDA
            self._write_ring(f, extra)
            return logits, None if extra is None else extra.view(b * t, -1), ints

        key = ("fused", b, t, step.capture, tree, verify, self._ring_key(ring))
        got = self.graphs.run(key, fn, packed=packed)
        logits, extra = got[0], got[1]
        assert logits is not None
        return row_outputs(logits, extra, rows, t), got[2] if verify else None


def _part(step: Step, rows: list[int]) -> Step:
    """The step of some of a step's rows."""
    hidden = None if step.hidden is None else [step.hidden[i] for i in rows]
    return Step([step.rows[i] for i in rows], step.capture, hidden)


def _merged(n: int, split: tuple[list[int], ...], parts: list[Sequence[T]]) -> list[T]:
    """The parts' results (each in its rows' order) back in the step's order of n rows."""
    out: list[T | None] = [None] * n
    for rows, part in zip(split, parts, strict=True):
        for i, x in zip(rows, part, strict=True):
            out[i] = x
    return out  # type: ignore[return-value]
