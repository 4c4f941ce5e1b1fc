"""The engines' host work per step, on any machine: the target's verify (a decode, a chain, a
tree) and the draft's extend-and-propose (a chain, a tree; each with a fresh one-row reference
written to the ring first) through the real engines and runtimes, with each step's model
computation replaced by its first result replayed (the graph a GPU would replay). What is left
is the Python and torch host calls around the model: the term `bench.cycle_anatomy` reports as
host work on the GPU. One JSON line per (engine, shape).

  python -m bench.engine_host --steps 2000
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
from specsplit.ops import ExtendPropose, HiddenRef, Prefill, Verify
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
    a = p.parse_args()
    target = TargetRuntime(TargetConfig(model=a.model, max_context=1024, max_sequences=2).validate(), TensorParallel())
    draft = DraftRuntime(DraftConfig(head="random", target=a.model, max_context=1024, max_sequences=2).validate())
    assert target.writer is not None
    draft.attach(target.writer.descriptor)
    target.engine.runner.padded = draft.engine.runner.padded = True  # the GPU's paths
    target.engine.runner.graphs.run = replayed(target.engine.runner.graphs.run)  # type: ignore[method-assign]
    draft.engine.runner.graphed = replayed(draft.engine.runner.graphed)  # type: ignore[method-assign]
    prompt = [100 + i for i in range(64)]
    (first,), _ = target.step([Prefill(1, prompt, capture=True)], [])
    assert first.hidden is not None
    target.writer.release(first.hidden.generation)  # read once below, before any other allocation
    seq, start = target.engine.seqs[1], len(prompt)
    common = {"bench": "engine_host", "model": a.model, "commit": git_commit(), "python": platform.python_version(),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}
    try:
        for name, steps, topk, size in (("chain", 5, 1, 0), ("tree", 5, 4, 16)):
            op = ExtendPropose(1, prompt[1:] + first.tokens, first.hidden, steps, position=0, topk=topk,
                               num_draft_tokens=size or 16)
            (d,), _ = draft.step([op])
            row = draft.engine.reader.read(first.hidden.offset, 1, first.hidden.inline).clone()  # type: ignore[union-attr]

            def propose(d_seq: Any = draft.engine.seqs[1], steps: int = steps, topk: int = topk, size: int = size,
                        row: Any = row) -> None:
                # each cycle's reference is a fresh ring row, released once read (the ring is FIFO)
                alloc = target.writer.allocate(1)  # type: ignore[union-attr]
                assert alloc is not None
                target.writer.write_all([(alloc, row)])  # type: ignore[union-attr]
                d_seq.length = start
                ref = HiddenRef(alloc.offset, 1, alloc.generation, alloc.inline)
                (r,), _ = draft.step([ExtendPropose(1, first.tokens, ref, steps, position=start, topk=topk,
                                                    num_draft_tokens=size or 16)])
                target.writer.release(alloc.generation)  # type: ignore[union-attr]
                assert r.code == 0, r.message

            def verify(ids: list[int] = d.draft_ids, parents: list[int] = d.draft_parents) -> None:
                seq.length, seq.tokens = start, seq.tokens[:start]
                (r,), _ = target.step([Verify(1, ids, draft_parents=parents, capture=True)], [])
                assert r.code == 0, r.message
                target.writer.release(r.hidden.generation)  # type: ignore[union-attr]

            print(json.dumps({**common, "engine": "draft", "shape": name, "num_steps": steps, "topk": topk,
                              "us_per_step": round(per_step_us(propose, a.steps, a.rounds), 1)}), flush=True)
            print(json.dumps({**common, "engine": "target", "shape": name, "tokens": len(d.draft_ids) + 1,
                              "us_per_step": round(per_step_us(verify, a.steps, a.rounds), 1)}), flush=True)

        def decode() -> None:
            seq.length, seq.tokens = start, seq.tokens[:start]
            (r,), _ = target.step([Verify(1, [], capture=False)], [])
            assert r.code == 0, r.message

        print(json.dumps({**common, "engine": "target", "shape": "decode", "tokens": 1,
                          "us_per_step": round(per_step_us(decode, a.steps, a.rounds), 1)}), flush=True)
    finally:
        target.close()


if __name__ == "__main__":
    main()
