"""Where one target decode step's time goes at batch 1 (the in-process baseline of bench.end_to_end
and bench.decode_hbm): the whole runtime step against the captured graph replayed alone (GPU time,
and launch + sync latency), and the kernels of the same static forward run eagerly under the
profiler, summed by name. One JSON line.

  python -m bench.step_anatomy --model smollm2 --device cuda:0
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any

import torch

from bench.spec_vs_baseline import git_commit
from specsplit.models.parallel import TensorParallel
from specsplit.ops import Prefill, Release, Verify
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime


def mean_us(fn: Any, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) * 1e6 / n, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    rt = TargetRuntime(TargetConfig(model=a.model, dtype=a.dtype, device=a.device, max_context=1024,
                                    max_sequences=2).validate(), TensorParallel())
    eng = rt.engine
    prompt = list(range(100, 100 + a.prompt_tokens))
    # warm-up over the whole range first, so that no graph of a later context bucket is captured while timing
    rt.step([Prefill(2, prompt, capture=False)], [])
    for _ in range(a.steps + 20):
        rt.step([Verify(2, [], capture=False)], [])
    rt.step([Release(2)], [])
    rt.step([Prefill(1, prompt, capture=False)], [])
    step = lambda: rt.step([Verify(1, [], capture=False)], [])  # noqa: E731
    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    step_us = (time.perf_counter() - t0) * 1e6 / a.steps
    graphs = eng.runner.graphs
    keys = list(graphs.graphs)
    key = next(k for k in keys if k[0] == "padded" and k[1] == 1 and k[2] == 1)
    graph = graphs.graphs[key].graph
    out: dict[str, Any] = {"bench": "step_anatomy", "model": a.model, "dtype": a.dtype, "graph_keys": len(keys),
                           "runtime_step_us": round(step_us, 1),
                           "graph_replay_back_to_back_us": mean_us(graph.replay, a.steps),
                           "graph_replay_then_sync_us": mean_us(lambda: (graph.replay(), torch.cuda.synchronize()),
                                                                a.steps)}
    # the same static forward eagerly, under the profiler: kernels summed by name
    graphs.enabled = False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name[ev.name][0] += 1
            by_name[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    total = sum(v[1] for v in by_name.values()) / 3
    out["eager_kernels_per_step"] = sum(v[0] for v in by_name.values()) / 3
    out["eager_kernel_us_per_step"] = round(total, 1)
    out["top_kernels"] = [{"name": n[:90], "calls_per_step": c / 3, "us_per_step": round(t / 3, 1)}
                          for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: a.top]]
    graphs.enabled = True
    rt.step([Release(1)], [])
    rt.close()
    out.update(gpu=torch.cuda.get_device_name(), commit=git_commit())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
