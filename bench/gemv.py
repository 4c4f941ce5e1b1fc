"""One-row GEMMs (batch-1 decode) of the Llama-3.1-8B shapes: cuBLAS (F.linear) against a
Triton GEMV, as achieved HBM bandwidth. Timed by replaying a CUDA graph of 20 calls on
weights larger than L2 (one copy per call, so no call reads another's weights from cache).

  python -m bench.gemv
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from specsplit.ops_triton import gemv

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}


def time_graph(fn, reps: int = 20, iters: int = 10) -> float:  # noqa: ANN001
    """Seconds per call of fn(i) for i in range(reps), replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(reps):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (iters * reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hbm-tb-s", type=float, default=4.8)
    p.add_argument("--rows", default="1", help="comma-separated batch rows M")
    a = p.parse_args()
    torch.manual_seed(0)
    for name, (n, k) in SHAPES_8B.items():
        reps = max(2, min(20, int(2e9 // (n * k * 2))))  # >= ~2 GB of weights per replay
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(reps)]
        for m in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            got = gemv(x, ws[0])
            err = (got.float() - ref.float()).abs().max().item()
            row = {"bench": "gemv", "shape": name, "n": n, "k": k, "m": m, "max_abs_diff": round(err, 5)}
            for impl, op in (("cublas", F.linear), ("triton", gemv)):
                t = time_graph(functools.partial(_call, op, x, ws), reps)
                row[f"{impl}_us"] = round(t * 1e6, 2)
                row[f"{impl}_frac_hbm"] = round(n * k * 2 / t / (a.hbm_tb_s * 1e12), 4)
            row["triton_speedup"] = round(row["cublas_us"] / row["triton_us"], 3)
            print(json.dumps(row), flush=True)
        del ws


def _call(op, x: torch.Tensor, ws: list[torch.Tensor], i: int) -> torch.Tensor:  # noqa: ANN001
    return op(x, ws[i])


if __name__ == "__main__":
    main()
