"""The engines' host work per step, on any machine: the target's verify (a decode, a chain, a
tree) and the draft's extend-and-propose (a chain, a tree; each with a fresh one-row reference
written to the ring first) through the real engines and runtimes, with each step's model
computation replaced by its first result replayed (the graph a GPU would replay). What is left
is the Python and torch host calls around the model: the term `bench.cycle_anatomy` reports as
host work on the GPU. `--batch` runs each step over that many sequences at once (one op each).
One JSON line per (engine, shape, batch).

  python -m bench.engine_host --steps 2000 --batch 1,8,32
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

from bench.spec_vs_baseline import git_commit
from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from specsplit.models.parallel import TensorParallel
from specsplit.ops import ExtendPropose, HiddenRef, Prefill, Release, Verify
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime


def replayed(run: Callable[..., Any]) -> Callable[..., Any]:
    """A graph cache's or runner's run that computes each key once and then returns that result."""
    seen: dict[tuple[object, ...], Any] = {}

    def fn(key: tuple[object, ...], step: Callable[..., Any], **inputs: Any) -> Any:
        if key not in seen:
            seen[key] = run(key, step, **inputs)
        return seen[key]

    return fn


def per_step_us(step: Callable[[], None], steps: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shape:smollm2-135m")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3, help="the best round is reported")
    p.add_argument("--batch", default="1", help="sequences a step, comma-separated")
    a = p.parse_args()
    batches = [int(b) for b in a.batch.split(",")]
    most = max(batches)
    target = TargetRuntime(TargetConfig(model=a.model, max_context=1024, max_sequences=most + 1).validate(),
                           TensorParallel())
    draft = DraftRuntime(DraftConfig(head="random", target=a.model, max_context=1024, max_sequences=most + 1,
                                     warm_up=False).validate())
    assert target.writer is not None
    writer = target.writer
    draft.attach(writer.descriptor)
    target.engine.runner.padded = draft.engine.runner.padded = True  # the GPU's paths
    target.engine.runner.graphs.run = replayed(target.engine.runner.graphs.run)  # type: ignore[method-assign]
    draft.engine.runner.graphed = replayed(draft.engine.runner.graphed)  # type: ignore[method-assign]
    prompt = [100 + i for i in range(64)]
    start = len(prompt)
    firsts = []
    for sid in range(1, most + 1):
        (first,), _ = target.step([Prefill(sid, prompt, capture=True)], [])
        assert first.hidden is not None
        firsts.append(first)
        writer.release(first.hidden.generation)  # read once below, before any other allocation
    common = {"bench": "engine_host", "model": a.model, "commit": git_commit(), "python": platform.python_version(),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}
    try:
        for b in batches:
            ids = range(1, b + 1)
            seqs = [target.engine.seqs[i] for i in ids]
            for name, steps, topk, size in (("chain", 5, 1, 0), ("tree", 5, 4, 16)):
                drafted = []
                for sid, first in zip(ids, firsts, strict=False):
                    op = ExtendPropose(sid, prompt[1:] + first.tokens, first.hidden, steps, position=0, topk=topk,
                                       num_draft_tokens=size or 16)
                    draft.step([Release(sid)])  # opened again from position 0
                    (d,), _ = draft.step([op])
                    assert d.code == 0, d.message
                    drafted.append(d)
                row = draft.engine.reader.read(firsts[0].hidden.offset, 1,  # type: ignore[union-attr]
                                               firsts[0].hidden.inline).clone()
                d_seqs = [draft.engine.seqs[i] for i in ids]

                def propose(d_seqs: list[Any] = d_seqs, steps: int = steps, topk: int = topk, size: int = size,
                            row: Any = row, b: int = b) -> None:
                    # each cycle's references are fresh ring rows, released once read (the ring is FIFO)
                    alloc = writer.allocate(b)
                    assert alloc is not None
                    writer.write_all([(alloc, row.expand(b, -1))])
                    ops = []
                    for j, (d_seq, first) in enumerate(zip(d_seqs, firsts, strict=False)):
                        d_seq.length = start
                        ref = HiddenRef(alloc.offset + j, 1, alloc.generation, alloc.inline)
                        ops.append(ExtendPropose(j + 1, first.tokens, ref, steps, position=start, topk=topk,
                                                 num_draft_tokens=size or 16))
                    results, _ = draft.step(ops)
                    writer.release(alloc.generation)
                    assert all(r.code == 0 for r in results), results[0].message

                def verify(drafted: list[Any] = drafted, seqs: list[Any] = seqs) -> None:
                    for seq in seqs:
                        seq.length, seq.tokens = start, seq.tokens[:start]
                    results, _ = target.step([Verify(j + 1, d.draft_ids, draft_parents=d.draft_parents,
                                                     capture=True) for j, d in enumerate(drafted)], [])
                    for r in results:
                        assert r.code == 0, r.message
                        writer.release(r.hidden.generation)  # type: ignore[union-attr]

                print(json.dumps({**common, "engine": "draft", "shape": name, "batch": b, "num_steps": steps,
                                  "topk": topk, "us_per_step": round(per_step_us(propose, a.steps, a.rounds), 1)}),
                      flush=True)
                print(json.dumps({**common, "engine": "target", "shape": name, "batch": b,
                                  "tokens": len(drafted[0].draft_ids) + 1,
                                  "us_per_step": round(per_step_us(verify, a.steps, a.rounds), 1)}), flush=True)

            def decode(seqs: list[Any] = seqs, b: int = b) -> None:
                for seq in seqs:
                    seq.length, seq.tokens = start, seq.tokens[:start]
                results, _ = target.step([Verify(j + 1, [], capture=False) for j in range(b)], [])
                assert all(r.code == 0 for r in results), results[0].message

            print(json.dumps({**common, "engine": "target", "shape": "decode", "batch": b, "tokens": 1,
                              "us_per_step": round(per_step_us(decode, a.steps, a.rounds), 1)}), flush=True)
    finally:
        target.close()


if __name__ == "__main__":
    main()
