"""One runner per engine, the same class for the target and the draft (nano-vllm's model runner).

The engine says what to compute: a `Step` of rows, each one sequence's new tokens. The runner
says how. It owns the model's KV cache and slots, the shape buckets and padding, the CUDA
graphs, and the execution path of each step:

- fused: the rows as fused kernels (a `FusedLlama`), padded to (batch bucket, longest row) up to
  its row limit, from a graph per shape;
- padded: the rows padded to (batch bucket, longest row, context bucket), from a graph per shape
  (on CUDA; eagerly on the same shapes without graphs, with identical results);
- eager: ragged, each row as long as it is (prompts, long rows, CPU serving).

On the CPU in fp32 the runner packs the model's projection weights for oneDNN once
(specsplit.models.parallel.pack_for_cpu), unless it compiles the model.

Engines with computations of their own between model steps (the draft's tree growth) build
them from `padded_forward` and capture them with `graphed`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specsplit.models.batch import Batch, Segment, tree_layout, tree_segment
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.fused import FusedLlama
from specsplit.models.layers import KVCache
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import pack_for_cpu
from specsplit.runner.graphs import GraphCache, Outputs, bucket_up, compile_static, pow2_buckets

Model = LlamaModel | Eagle3Head  # logits with captured features, or with pre-norm states


@dataclass
class Row:
    """One sequence's new tokens: they write KV entries start, start+1, ... of `slot`."""

    slot: int
    start: int  # committed entries of the slot, all visible to the row
    tokens: list[int]
    parents: list[int] | None = None  # a tree: each token's parent in `tokens` (-1: after the committed entries)


@dataclass
class Step:
    rows: list[Row]
    capture: bool = False  # the target: also the capture layers' outputs
    hidden: list[torch.Tensor] | None = None  # the head: each row's hidden input [len(tokens), W]


RowOutput = tuple[torch.Tensor, torch.Tensor | None]  # logits [T, V]; captured features or pre-norm states [T, X]


class ModelRunner:
    def __init__(self, model: Model, slots: int, max_len: int, *, cuda_graphs: bool = True,
                 compile: bool = False, fused: FusedLlama | None = None, padded_tokens: int = 0,
                 row_bucket: Callable[[int], int] | None = None) -> None:
        """`slots` sequences of up to `max_len` KV entries each; rows of up to `padded_tokens`
        tokens run padded on CUDA, to the longest row (or its `row_bucket`: fewer graphs); `fused`
        (a FusedLlama) takes the steps whose padded rows fit it."""
        self.model = model
        self.device = next(model.parameters()).device
        pack_for_cpu(model, pack=not compile)  # (inductor lowers oneDNN's packed products only in frozen graphs)
        self.cache: KVCache = model.new_cache(slots + 1, max_len)  # the extra slot takes padding rows
        self.pad_slot = slots
        self._free = list(range(slots - 1, -1, -1))
        self.graphs = GraphCache(self.device, cuda_graphs)
        self.padded = self.device.type == "cuda"  # steps of short rows padded (tests turn it on on the CPU)
        self.padded_tokens = padded_tokens
        self.row_bucket = row_bucket
        self.fused = fused
        self.compiled = compile
        self._padded_fn = compile_static(self._padded_forward) if compile else self._padded_forward
        self.batch_buckets = pow2_buckets(1, slots)
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

    def run(self, step: Step) -> list[RowOutput]:
        """Each row's logits [T, V] and features [T, X] (views of graph outputs: valid until the
        next step of the same shape)."""
        t = max(len(r.tokens) for r in step.rows)
        continuing = all(r.start > 0 for r in step.rows)  # prompts (rows from entry 0) run eager
        with self.mode():
            if continuing and self.fused is not None and self.batch_bucket(len(step.rows)) * t <= self.fused.max_rows:
                return self._run_fused(step)
            if continuing and self.padded and t <= self.padded_tokens:
                return self._run_padded(step)
            return self._run_eager(step)

    def graphed(self, key: tuple[object, ...], fn: Callable[..., Outputs], **inputs: torch.Tensor) -> Outputs:
        """fn(**inputs) from a CUDA graph of this key (captured on first use); inputs may be host tensors."""
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
        logits, extra = self.model.forward(tokens.reshape(b * t), batch, self.cache)
        return logits.view(b, t, -1), None if extra is None else extra.view(b, t, -1)

    def _run_eager(self, step: Step) -> list[RowOutput]:
        dev = self.device
        segments = [tree_segment(r.slot, r.start, r.parents, dev) if r.parents
                    else Segment(r.slot, r.start, len(r.tokens)) for r in step.rows]
        tokens = torch.tensor([t for r in step.rows for t in r.tokens], dtype=torch.long, device=dev)
        hidden = None if step.hidden is None else torch.cat(step.hidden).to(dev)
        logits, extra = self.model.forward(tokens, Batch.ragged(segments, dev, step.capture, hidden), self.cache)
        out, off = [], 0
        for r in step.rows:
            part = slice(off, off + len(r.tokens))
            off += len(r.tokens)
            out.append((logits[part], None if extra is None else extra[part]))
        return out

    def _run_padded(self, step: Step) -> list[RowOutput]:
        """The rows padded to the batch bucket, each to the longest row T, in one host tensor
        [B, 3T + 1 (+ T*T with trees)]: tokens, rotary positions, entries, slot (and the tree
        mask). Padding tokens write entries past their row that later steps overwrite; padding
        rows write the spare slot."""
        rows = step.rows
        b, t = self.batch_bucket(len(rows)), max(len(r.tokens) for r in rows)
        if self.row_bucket is not None:
            t = self.row_bucket(t)
        ctx = self.ctx_bucket(max(r.start for r in rows) + t)
        tree = any(r.parents for r in rows)
        pad = Row(self.pad_slot, 0, [])
        ints = torch.tensor([_pack(r, t, tree) for r in [*rows, *[pad] * (b - len(rows))]])
        inputs = {"ints": ints}
        if step.hidden is not None:
            inputs["hidden"] = padded_rows(step.hidden, b, t)

        def fn(ints: torch.Tensor, hidden: torch.Tensor | None = None) -> Outputs:
            tokens, positions, entries, slots = ints[:, :t], ints[:, t : 2 * t], ints[:, 2 * t : 3 * t], ints[:, 3 * t]
            tree_mask = ints[:, 3 * t + 1 :].view(b, t, t) if tree else None
            return self.padded_forward(tokens, positions, slots, entries, ctx, tree_mask, hidden=hidden,
                                       capture=step.capture)

        width = None if step.hidden is None else step.hidden[0].shape[-1]
        logits, extra = self.graphs.run(("padded", b, t, ctx, tree, step.capture, width), fn, **inputs)
        assert logits is not None
        return [(logits[i, : len(r.tokens)], None if extra is None else extra[i, : len(r.tokens)])
                for i, r in enumerate(rows)]

    def _run_fused(self, step: Step) -> list[RowOutput]:
        """The rows padded to (batch bucket B, longest row T) as the fused step, its inputs in one
        host tensor of fields side by side: tokens [B*T], rotary positions [B, T], entries [B, T],
        slots [B], masks [B, T, T]."""
        rows, fused = step.rows, self.fused
        assert fused is not None
        b, t = self.batch_bucket(len(rows)), max(len(r.tokens) for r in rows)
        padded = [_pack(r, t, True) for r in [*rows, *[Row(self.pad_slot, 0, [])] * (b - len(rows))]]
        cuts = [0, t, 2 * t, 3 * t, 3 * t + 1, 3 * t + 1 + t * t]
        packed = torch.tensor([x for lo, hi in itertools.pairwise(cuts) for p in padded for x in p[lo:hi]])
        bt = b * t

        def fn(packed: torch.Tensor) -> Outputs:
            tokens, positions, entries = packed[:bt], packed[bt : 2 * bt].view(b, t), packed[2 * bt : 3 * bt].view(b, t)
            slots, mask = packed[3 * bt : 3 * bt + b], packed[3 * bt + b :].view(b, t, t)
            return fused.forward(tokens, Batch.padded(positions, slots, entries, 0, mask, capture=step.capture),
                                 self.cache)

        logits, extra = self.graphs.run(("fused", b, t, step.capture), fn, packed=packed)
        assert logits is not None
        return [(logits[i * t : i * t + len(r.tokens)], None if extra is None else extra[i * t : i * t + len(r.tokens)])
                for i, r in enumerate(rows)]


def _pack(row: Row, t: int, tree: bool) -> list[int]:
    """A row padded to t tokens: tokens, rotary positions, entries, slot (and with `tree` its
    [t, t] mask: the tree's ancestors-and-self, causal for chains and padding tokens)."""
    n, entries = len(row.tokens), list(range(row.start, row.start + t))
    positions, mask = list(entries), []
    if tree:
        mask = [int(j <= i) for i in range(t) for j in range(t)]
        if row.parents:
            tree_positions, rows, cols = tree_layout(row.start, row.parents)
            positions[:n] = tree_positions
            for i in range(n):
                mask[i * t : i * t + n] = [0] * n
            for i, c in zip(rows, cols, strict=True):
                mask[i * t + c - row.start] = 1
    return [*row.tokens, *[0] * (t - n), *positions, *entries, row.slot, *mask]


def padded_rows(rows: list[torch.Tensor], b: int, t: int) -> torch.Tensor:
    """Rows [T_i, W] as [b, t, W], zero-padded (a view when one row fills the batch)."""
    if b == 1 and rows[0].shape[0] == t:
        return rows[0][None]
    out = rows[0].new_zeros(b, t, rows[0].shape[-1])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out
