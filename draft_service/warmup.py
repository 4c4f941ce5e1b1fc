"""Every shape of a one-sequence batch, run once before serving.

On the GPU the first run of a shape compiles its Triton kernels (seconds on a machine without
Triton's cache) and captures its CUDA graph (milliseconds): a request that met a new shape mid-stream
(a deeper draft, a longer extend) would stall for that long, and a gateway that chooses the
steps per cycle meets many. So the draft runs, for one sequence, every extend bucket of a cycle
(1 up to max_steps + 1 tokens) and of the extends put off (longer, up to the runner's padded
rows), each at every depth up to max_steps and each branching of `topks`, and a cycle's extend
alone (depth 0: an adaptive request's extends put off, then made in a cycle that drafts nothing
for it; the extend then runs as a step of its own, not in the graph of a proposal):

- at start, eagerly: the kernels compile (no graph is captured: where the features will come
  from, the target's ring or the messages, is not known before the target attaches);
- once the target's hidden-state store is attached (after the attach's reply: the service's
  steps wait for it), from graphs: the graphs that read their features from where serving
  will read them are captured, and a prompt's extend of one row in every length bucket
  (runner.prompts.warm_prompts).

The graphs have no context dimension (draft_service.engine: `_views`), so these shapes serve
every context length. The eager pass also runs a cycle of every batch bucket (`batch_shapes`),
so that a batch's kernels are compiled before serving; its graphs are captured on first use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import torch

from draft_service.engine import DraftEngine, DraftSequence, Work
from specsplit.ops import ExtendPropose, HiddenRef, Sampling, extend_bucket
from specsplit.runner.prompts import GRAPH_TOKENS, warm_prompts

log = logging.getLogger("specsplit.draft")


def extend_lengths(max_steps: int, padded_tokens: int) -> list[int]:
    """Tokens of one extend for each bucket a cycle's extends (1..max_steps + 1 tokens: one graph
    with the proposal) and the extends put off (longer, up to `padded_tokens`: the padded step,
    then the proposal) fall in: the shortest of each bucket."""
    cycle: dict[int, int] = {}
    for n in range(1, max_steps + 2):
        cycle.setdefault(extend_bucket(n), n)
    put_off: dict[int, int] = {}
    for n in range(max_steps + 2, padded_tokens + 1):
        put_off.setdefault(extend_bucket(n), n)
    return [*cycle.values(), *put_off.values()]


def shapes(engine: DraftEngine, topks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(tokens extended, steps, topk) of every shape warmed: steps 0 (the extend alone) for a
    cycle's extends (a longer one alone runs the padded step that precedes its proposal)."""
    lengths = extend_lengths(engine.max_steps, engine.runner.padded_tokens)
    for n in (n for n in lengths if n <= engine.max_steps + 1):
        yield n, 0, 1
    for topk in sorted({k for k in topks if 1 <= k <= engine.max_topk}):
        for steps in range(1, engine.max_steps + 1):
            for n in lengths:
                yield n, steps, topk


def batch_shapes(engine: DraftEngine, topks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(sequences, tokens extended, topk) of the batches the eager pass runs at the deepest draft:
    every batch bucket past one that the free slots hold, the shortest and the longest extend of
    a cycle, each branching of `topks`, so that the kernels of every batch shape compile before
    serving (a batch's graphs are captured at first use, in tens of milliseconds)."""
    r = engine.runner
    for b in (b for b in r.batch_buckets[1:] if b <= r.free_slots):
        for topk in sorted({k for k in topks if 1 <= k <= engine.max_topk}):
            for n in (1, engine.max_steps + 1):
                yield b, n, topk


def _run_batch(engine: DraftEngine, b: int, n: int, topk: int, zeros: torch.Tensor) -> None:
    """One cycle of b scratch sequences extending n tokens each (features zeros), at the deepest draft."""
    r, steps = engine.runner, engine.max_steps
    seqs = [DraftSequence(r.allocate(), 1, Sampling(), torch.Generator(device=engine.device), engine.epoch)
            for _ in range(b)]
    try:
        engine.extend_and_propose([Work(i, ExtendPropose(-1, [0] * n, HiddenRef(0, n, 0), steps, position=1,
                                                         topk=topk, num_draft_tokens=steps * topk + 1),
                                        seq, zeros[:n]) for i, seq in enumerate(seqs)], None)
    finally:
        for seq in seqs:
            r.release(seq.slot)


def warm_up(engine: DraftEngine, topks: Sequence[int], capture: bool, ring: torch.Tensor | None = None) -> int:
    """Run every shape of `shapes` once for a scratch sequence, eagerly or (`capture`) from
    graphs; its features read from rows 0.. of `ring` (whatever they hold: the proposals are
    dropped), or without a ring zeros passed in. Returns the shapes run: none where the draft
    runs no graphs (the CPU) or compiles each (--compile: tens of seconds a shape)."""
    r = engine.runner
    if not (r.padded and r.graphs.enabled) or r.graphs.compile:
        return 0
    if not r.free_slots:  # (attached again while every slot serves: shapes capture on first use)
        log.info("draft shapes not warmed: no free KV slot")
        return 0
    started, n_shapes = time.perf_counter(), 0
    width = 3 * engine.head.cfg.target_hidden_size
    dtype = next(engine.head.parameters()).dtype
    longest = max(extend_lengths(engine.max_steps, r.padded_tokens))
    zeros = torch.zeros(longest, width, dtype=dtype, device=engine.device)  # [tokens, 3H]
    # positions > 0: a cycle's extend continues a sequence (an extend from 0 runs eagerly)
    batches = [] if capture else list(batch_shapes(engine, topks))
    seq = DraftSequence(r.allocate(), 1, Sampling(), torch.Generator(device=engine.device), engine.epoch)
    r.graphs.enabled = capture
    try:
        with r.mode():
            if capture:  # prompts: one row of every length bucket (their features zeros)
                n_shapes += warm_prompts(r, seq.slot, (False,), False,
                                         torch.zeros(GRAPH_TOKENS, width, dtype=dtype, device=engine.device))
            for n, steps, topk in shapes(engine, topks):
                if seq.length + n + engine.max_steps * engine.max_topk >= engine.max_context:
                    seq.length = 1
                op = ExtendPropose(-1, [0] * n, HiddenRef(0, n, 0), steps, position=seq.length, topk=topk,
                                   num_draft_tokens=steps * topk + 1 if steps else 0)
                work = Work(0, op, seq, None, list(range(n))) if ring is not None else Work(0, op, seq, zeros[:n])
                engine.extend_and_propose([work], ring)
                n_shapes += 1
            r.release(seq.slot)
            seq.slot = -1
            for b, n, topk in batches:  # the eager pass: batches, for their kernels
                _run_batch(engine, b, n, topk, zeros)
                n_shapes += 1
    finally:
        r.graphs.enabled = True
        if seq.slot >= 0:
            r.release(seq.slot)
    log.info("draft shapes warmed %s: %d in %.1f s", "from graphs" if capture else "eagerly (kernels)",
             n_shapes, time.perf_counter() - started)
    return n_shapes
