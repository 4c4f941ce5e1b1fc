"""Prompt steps of the target on the GPU, in process (TargetRuntime, its warm-up included): how
long the runtime takes to start, and what a step of N new prompts of one length costs, ms, its
first run and each of its repeats, with the graphs captured while serving. One JSON line with the
start-up, then one per (rows, length).

  python -m bench.prompt_steps --model shape:smollm2-135m --shapes 1x40,2x40,4x40,8x40,16x20 --capture 3x100
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.spec_vs_baseline import git_commit
from specsplit.models.parallel import TensorParallel
from specsplit.ops import Prefill, Release
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime


def shapes(text: str) -> list[tuple[int, int]]:
    """'1x40,4x40' -> [(1, 40), (4, 40)]: prompts a step x tokens a prompt."""
    return [(int(n), int(t)) for n, t in (s.split("x") for s in text.split(",") if s)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shape:smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--fused-decode", default="pdl")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--shapes", default="1x40,2x40,4x40,8x40,16x20", help="prompts a step x tokens, without features")
    p.add_argument("--capture", default="3x100", help="the same, with the capture layers' features (speculation)")
    p.add_argument("--repeats", type=int, default=6, help="steps of each shape, the first included")
    a = p.parse_args()
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    rt = TargetRuntime(TargetConfig(model=a.model, dtype=a.dtype, device=a.device, fused_decode=a.fused_decode,
                                    hidden_backend="cuda_ipc" if cuda else "shm", max_context=a.max_context,
                                    max_sequences=16).validate(), TensorParallel())
    start_s = time.perf_counter() - t0
    graphs = rt.engine.runner.graphs
    common = {"bench": "prompt_steps", "model": a.model, "dtype": a.dtype,
              "gpu": torch.cuda.get_device_name() if cuda else "cpu", "commit": git_commit()}
    print(json.dumps({**common, "startup_s": round(start_s, 1), "graphs_at_start": len(graphs.graphs),
                      "prompt_graphs_at_start": sum(k[0] == "prompts" for k in graphs.graphs)}), flush=True)
    seq = 0
    for capture, spec in ((False, a.shapes), (True, a.capture)):
        for n, length in shapes(spec):
            ms, before = [], graphs.late_captures
            for _ in range(a.repeats):
                ids = list(range(seq, seq + n))
                seq += n
                sync()
                t = time.perf_counter()
                res, _ = rt.step([Prefill(i, [5 + i % 7] * length, capture=capture) for i in ids], [])
                sync()
                ms.append(round((time.perf_counter() - t) * 1e3, 2))
                if any(r.code for r in res):
                    raise RuntimeError(f"prefill failed: {[r.message for r in res if r.code]}")
                rt.step([Release(i) for i in ids], [r.hidden.generation for r in res if r.hidden is not None])
            print(json.dumps({**common, "rows": n, "tokens": length, "features": capture, "first_ms": ms[0],
                              "repeat_ms": sorted(ms[1:])[len(ms[1:]) // 2] if len(ms) > 1 else None,
                              "ms": ms, "captured_while_serving": graphs.late_captures - before}), flush=True)
    rt.close()


if __name__ == "__main__":
    main()
