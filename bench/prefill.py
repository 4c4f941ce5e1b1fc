"""The target's prefill step of N chat prompts, side by side in one run: the prompts layout the
runner takes (rows grouped by padded length, a forward a group, logits of each row's last token
only) against the same rows through the ragged layout (a forward over all rows, attention a
segment at a time, every token's logits). For each: milliseconds a step (the median of
--repeats, synchronised on CUDA) and the torch operations it calls from Python (aten operations
not inside another one, as the profiler records them), all and those that are not views: on the
GPU each of the latter launches a kernel or more, the host cost of an eager step (on CUDA the
prompts layout replays a graph per shape up to specsplit.runner.prompts.GRAPH_TOKENS padded
tokens, captured at the first step: its calls are then the graph's inputs and outputs).
One JSON line per (N, layout), with the ratio to the ragged layout.

  python -m bench.prefill --prompts 1,8,32                                     (CPU, fp32)
  python -m bench.prefill --model <GGUF> --device cuda:0 --dtype bfloat16 --prompts 1,8,32,64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.prompts import CHAT_PROMPTS
from bench.spec_vs_baseline import git_commit
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.models.parallel import TensorParallel
from specsplit.runner.runner import ModelRunner, Row, Step
from specsplit.tokenizer import TextCodec
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime


def is_view(name: str) -> bool:
    """Whether the aten operation of this profiler name returns a view (no kernel)."""
    op = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    return op is not None and any(getattr(op, o).is_view for o in op.overloads())


def count_ops(fn: Callable[[], None]) -> tuple[int, int]:
    """The torch operations fn calls from Python (aten operations not inside another one): all,
    and those that are not views."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events() if e.name.startswith("aten::")
             and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return len(names), sum(not is_view(n) for n in names)


def prompts_step(r: ModelRunner, rows: list[Row]) -> None:
    r.verify(Step(rows, capture=True))


def ragged_step(r: ModelRunner, rows: list[Row]) -> None:
    with r.mode():
        _, ints = r._run_eager(Step(rows, capture=True), True)
        assert ints is not None
        ints.tolist()


def measure(r: ModelRunner, prompts: list[list[int]], n: int, step: Callable[[ModelRunner, list[Row]], None],
            repeats: int) -> dict[str, Any]:
    sync = torch.cuda.synchronize if r.device.type == "cuda" else (lambda: None)

    def once() -> float:
        rows = [Row(r.allocate(), 0, prompts[i % len(prompts)]) for i in range(n)]
        try:
            sync()
            t0 = time.perf_counter()
            step(r, rows)
            sync()
            return (time.perf_counter() - t0) * 1e3
        finally:
            for row in rows:
                r.release(row.slot)

    once()  # first use: allocations, kernel selection
    ms = statistics.median(once() for _ in range(repeats))
    ops, kernels = count_ops(once)
    return {"ms": round(ms, 3), "ops": ops, "kernel_ops": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", default="1,8,32", help="prompts a step (comma-separated)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    counts = [int(x) for x in a.prompts.split(",") if x]
    codec = TextCodec.from_checkpoint(resolve_target_dir(a.model))
    if codec is None:
        raise SystemExit(f"{a.model}: no tokenizer")
    prompts = [codec.encode(codec.render_chat(t)) for t in CHAT_PROMPTS]
    cfg = TargetConfig(model=a.model, dtype=a.dtype, device=a.device, max_sequences=max(counts),
                       fused_decode="off", hidden_backend="inline").validate()
    runner = TargetRuntime(cfg, TensorParallel()).engine.runner
    for n in counts:
        got = {name: measure(runner, prompts, n, fn, a.repeats)
               for name, fn in (("ragged", ragged_step), ("prompts", prompts_step))}
        for name, m in got.items():
            print(json.dumps({"bench": "prefill", "layout": name, "prompts": n, **m,
                              "tokens": sum(len(prompts[i % len(prompts)]) for i in range(n)),
                              "ms_vs_ragged": round(m["ms"] / got["ragged"]["ms"], 3),
                              "kernel_ops_vs_ragged": round(m["kernel_ops"] / got["ragged"]["kernel_ops"], 3),
                              "model": a.model, "device": a.device, "dtype": a.dtype,
                              "host": platform.node(), "commit": git_commit()}), flush=True)


if __name__ == "__main__":
    main()
