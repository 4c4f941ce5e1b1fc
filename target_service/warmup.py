"""Every verify shape the fused step serves, run once before serving.

On the GPU the first run of a shape compiles its Triton kernels (seconds on a machine without
Triton's cache; the multi-row attention compiles once per bucket of a sequence's rows) and
captures its CUDA graph (tens of milliseconds): a step that met a new shape mid-run would hold up
every stream of the batch for that long. So the target runs, on a scratch slot (the other rows of a batch on
the padding slot), for every batch bucket B and every verify length T (1 up to
max_draft_tokens + 1) whose B·T rows fit the fused step:

- T = 1: a row without features (a cycle that drafted nothing), and with features, into the
  ring and without;
- T > 1: a chain and a tree with features (into the ring's first rows where it is set, as
  served), accepted on the device;

then the attention's other tile heights (20 and 40 rows of one sequence); for every batch
bucket, decodes of 2, 4, ... tokens a call (decoding ahead) up to max_draft_tokens + 1, greedy
and sampled; and before them a prompt of one row in every length bucket that runs from a graph
(runner.prompts.warm_prompts).
"""

from __future__ import annotations

from collections.abc import Iterator

from specsplit.ops import Sampling
from specsplit.runner.prompts import warm_prompts
from specsplit.runner.runner import Row, Step
from specsplit.sampling import sampling_rows
from target_service.engine import TargetEngine


def verify_steps(engine: TargetEngine, slot: int) -> Iterator[Step]:
    """The verify steps warmed, slot's row first in each (see the module's docstring)."""
    runner, fused = engine.runner, engine.runner.fused
    assert fused is not None
    ring_row = 0 if runner.ring is not None else -1
    most = min(engine.cfg.max_draft_tokens + 1, fused.max_seq_rows)

    def step(b: int, t: int, parents: list[int] | None, capture: bool, ring: int) -> Step:
        rows = [Row(s, 8, [0] * t, parents, True, ring) for s in [slot] + [runner.pad_slot] * (b - 1)]
        return Step(rows, capture=capture)

    for b in runner.batch_buckets:
        for t in range(1, min(most, fused.max_rows // b) + 1):
            if t == 1:
                yield step(b, 1, None, False, -1)
                if ring_row >= 0:
                    yield step(b, 1, None, True, -1)
            yield step(b, t, None, True, ring_row)
            if t > 1:  # a tree (shaped as a chain: the graphs depend on the rows only)
                yield step(b, t, [-1, *range(t - 1)], True, ring_row)
    for rows in (20, 40):
        if fused.takes(1, rows):
            yield step(1, rows, None, True, -1)


def warm_up(engine: TargetEngine) -> int:
    """Run every shape of the module's docstring once for a scratch slot, freed after. Returns the
    shapes run (none without a fused step)."""
    runner, fused = engine.runner, engine.runner.fused
    if fused is None:
        return 0
    slot = runner.allocate()
    n = 0
    try:
        with runner.mode():  # prompts: one row of every length bucket, with features and without
            n += warm_prompts(runner, slot)
        runner.run(Step([Row(slot, 0, [0] * 8)]))  # committed entries for the steps to see
        for step in verify_steps(engine, slot):
            runner.verify(step)
            n += 1
        ahead = [1 << i for i in range(1, (engine.cfg.max_draft_tokens + 1).bit_length())]
        for b in (b for b in runner.batch_buckets if fused.takes(b, 1)):
            rows = [Row(slot, 8, [0], accept=True), *[Row(runner.pad_slot, 8, [0], accept=True)] * (b - 1)]
            for k in ahead:  # greedy rows, and rows that sample
                runner.decode(Step(rows), k)
                runner.decode(Step(rows), k, sampling_rows([Sampling(temperature=1.0)] * b))
                n += 2
    finally:
        runner.release(slot)
    return n
