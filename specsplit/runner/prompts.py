"""Rows from entry 0 (prompts, recomputed sequences): a few forwards for any number of them.

Each row is padded to its own length's bucket, so its shape, and with it the bits it computes,
do not depend on the other rows of its step; rows of one bucket run as one forward of the
prompts layout (specsplit.models.batch), up to PROMPT_TOKENS padded tokens a forward. Attention
then takes no mask and reads no cache, and the model computes logits for each row's last token
only: a prefill needs no others, and they would be the largest tensor of the step. On CUDA a
forward of up to GRAPH_TOKENS padded tokens replays a graph of its shape (its rows' count padded
to the runner's batch bucket, padding rows in the spare slot): eagerly, its hundreds of kernel
launches cost more than their compute. The engine captures the one-row graphs of every bucket
before serving (warm_prompts); while serving, a step of a few rows whose graph is missing runs
its rows one at a time from those instead of capturing one: a capture holds up every running
sequence for a tenth of a second or more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from specsplit.models.batch import Batch
from specsplit.runner.graphs import Outputs
from specsplit.runner.outputs import RowOutputs, Verified
from specsplit.runner.packing import Row, padded_rows

if TYPE_CHECKING:
    from specsplit.runner.runner import ModelRunner

PROMPT_TOKENS = 8192  # padded tokens of one forward (a longer row runs alone)
GRAPH_TOKENS = 1024  # forwards of up to this many padded tokens run from CUDA graphs (longer ones: their compute)
GRAPH_SHAPES = 96  # prompt shapes captured at most, the others eagerly: the runner's other graphs keep their room
# While serving, a step of up to this many rows of one bucket whose graph is missing runs them one
# at a time from their one-row graphs (warm_prompts): a few ms a row at SmolLM2's size, against a
# capture that holds up every running sequence for ~0.1 s (docs/benchmarks.md, bench.concurrency).
# More rows capture their graph at first use: eagerly the first run of a new shape costs about as
# much, and every later one several times a replay.
ONE_BY_ONE_ROWS = 4
log = logging.getLogger("specsplit.runner")


def prompt_bucket(n: int, most: int) -> int:
    """The padded length of a row of n tokens: a multiple of 16 up to 256, of 64 above; at most `most`."""
    step = 16 if n <= 256 else 64
    return min(-(-n // step) * step, most)


def prompt_buckets(most: int) -> list[int]:
    """Every padded length a row of up to `most` tokens takes."""
    return sorted({prompt_bucket(n, most) for n in range(1, most + 1)})


def prompt_groups(lengths: list[int], most: int) -> list[list[int]]:
    """Indices of rows that run as one forward: those of one bucket, longest bucket first, in
    their order, at most PROMPT_TOKENS padded tokens a group (at least one row)."""
    by_bucket: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_bucket.setdefault(prompt_bucket(n, most), []).append(i)
    groups = []
    for t in sorted(by_bucket, reverse=True):
        rows = by_bucket[t]
        size = max(1, PROMPT_TOKENS // t)
        groups += [rows[j : j + size] for j in range(0, len(rows), size)]
    return groups


def run_prompts(runner: ModelRunner, rows: list[Row], hidden: list[torch.Tensor] | None, capture: bool,
                verify: bool) -> list[Verified]:
    """Each row's outputs (logits [1, V] of its last token, features [T, X]) and, with `verify`,
    the argmax after its last token (`best`; one readback per forward). A forward is a static
    function of its rows' count (for a graph: their batch bucket, padding rows in the spare slot)
    and their length's bucket."""
    out: list[Verified | None] = [None] * len(rows)
    width = None if hidden is None else hidden[0].shape[-1]
    for group in _groups(runner, rows, capture, width, verify):
        lengths = [len(rows[i].tokens) for i in group]
        n, t = len(group), prompt_bucket(max(lengths), runner.cache.max_len)
        b = runner.batch_bucket(n)  # padding rows only for a graph's shape: eagerly they would be wasted work
        b = b if runner.graphs.enabled and b * t <= GRAPH_TOKENS else n
        ints = np.zeros((b, t + 2), dtype=np.int64)  # [B, T + 2]: tokens, slot, length (padding rows: 1 token)
        for j, i in enumerate(group):
            ints[j, : lengths[j]] = rows[i].tokens
        ints[:, t] = [rows[i].slot for i in group] + [runner.pad_slot] * (b - n)
        ints[:, t + 1] = lengths + [1] * (b - n)
        inputs: dict[str, np.ndarray | torch.Tensor] = {"ints": ints}
        if hidden is not None:  # [B*T, W]
            inputs["hidden"] = padded_rows([hidden[i] for i in group], b, t).view(b * t, -1)

        def fn(ints: torch.Tensor, hidden: torch.Tensor | None = None, t: int = t) -> Outputs:
            ends = torch.arange(ints.shape[0], device=ints.device) * t + ints[:, t + 1] - 1  # [B] each row's last token
            batch = Batch.prompt_rows(ends, ints[:, t], t, capture, hidden)
            logits, extra = runner.model.forward(ints[:, :t].reshape(-1), batch, runner.cache)  # [B, V], [B*T, X]
            return logits, extra, logits.argmax(-1) if verify else None

        key = _key(b, t, capture, width, verify)
        (logits, extra, best), graphed = _forward(runner, key, b * t, fn, inputs)
        assert logits is not None
        if graphed:  # a graph's outputs: another forward of its shape in the same step would overwrite them
            logits, extra = logits[:n].clone(), None if extra is None else extra[: n * t].clone()
        outputs = RowOutputs(logits, extra, [(j * t, j * t + m) for j, m in enumerate(lengths)],
                             [(j, j + 1) for j in range(n)])
        tops = best[:n].tolist() if best is not None else [-1] * n
        for j, i in enumerate(group):
            out[i] = Verified(outputs, j, [0], [tops[j]])
    return out  # type: ignore[return-value]


def warm_prompts(runner: ModelRunner, slot: int, captures: tuple[bool, ...] = (False, True),
                 verify: bool = True, hidden: torch.Tensor | None = None) -> int:
    """Capture the graph of one row of every length bucket a prompt graph serves (up to
    GRAPH_TOKENS), with and without the capture layers' features (`captures`), on `slot`, each row's
    input features the first rows of `hidden` [GRAPH_TOKENS, W] (the draft's): before serving, so
    that no request meets a capture (about 0.1 s each on an H100, while every running sequence
    waits). Returns the shapes captured (0 without graphs)."""
    if not runner.graphs.enabled:
        return 0
    n, width = 0, None if hidden is None else hidden.shape[-1]
    for t in prompt_buckets(min(GRAPH_TOKENS, runner.cache.max_len)):
        for capture in captures:
            if _key(1, t, capture, width, verify) not in runner.graphs.graphs:
                run_prompts(runner, [Row(slot, 0, [0] * t)], None if hidden is None else [hidden[:t]], capture,
                            verify)
                n += 1
    return n


def _key(b: int, t: int, capture: bool, width: int | None, verify: bool) -> tuple[object, ...]:
    return ("prompts", b, t, capture, width, verify)


def _groups(runner: ModelRunner, rows: list[Row], capture: bool, width: int | None, verify: bool
            ) -> list[list[int]]:
    """prompt_groups, where a group of up to ONE_BY_ONE_ROWS rows whose graph was not captured
    before serving runs one row at a time from the one-row graphs."""
    graphs, out = runner.graphs, []
    for group in prompt_groups([len(r.tokens) for r in rows], runner.cache.max_len):
        t = prompt_bucket(max(len(rows[i].tokens) for i in group), runner.cache.max_len)
        b = runner.batch_bucket(len(group))
        uncaptured = (graphs.serving and len(group) > 1 and b * t <= GRAPH_TOKENS
                      and _key(b, t, capture, width, verify) not in graphs.graphs)
        if uncaptured and len(group) <= ONE_BY_ONE_ROWS and _key(1, t, capture, width, verify) in graphs.graphs:
            out += [[i] for i in group]
        else:
            out.append(group)
    return out


def _forward(runner: ModelRunner, key: tuple[object, ...], tokens: int, fn: Callable[..., Outputs],
             inputs: dict[str, np.ndarray | torch.Tensor]) -> tuple[Outputs, bool]:
    """fn's outputs, from the CUDA graph of its shape where prompt steps take one (up to
    GRAPH_TOKENS padded tokens and GRAPH_SHAPES shapes, on a device where capturing them works),
    else eagerly; and whether from a graph."""
    graphs = runner.graphs
    if key not in graphs.graphs and (not graphs.enabled or tokens > GRAPH_TOKENS or "prompts" in graphs.refused
                                     or sum(k[0] == "prompts" for k in graphs.graphs) >= GRAPH_SHAPES):
        return graphs.eager(fn, **inputs), False
    try:
        return graphs.run(key, fn, **inputs), True
    except RuntimeError as e:
        if key in graphs.graphs:  # a replay's failure, not a capture's
            raise
        log.warning("prompt steps run eagerly from now on: capturing one failed (%s)", e)
        graphs.refused.add("prompts")
        return graphs.eager(fn, **inputs), False
