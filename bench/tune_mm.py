"""Measure the plans of the multi-row projections (kernels.projections: the fused verify's and the
batched decode's) on this GPU, and pin them (kernels/mm_plans.json, read by kernels.blocks):
every projection of the multi-row step of each --shapes model, a tile of 16 rows (the
projections' ROW_TILE), every candidate of kernels.blocks.mm_candidates, µs per launch. A launch
reads its weights from HBM as in a step (the graph cycles through copies of the matrix that
together exceed the L2 cache).
One JSON line per matrix: the fastest plan, and what the pinned table and the rule give.

  python -m bench.tune_mm                          # SmolLM2-135M's matrices
  python -m bench.tune_mm --write                  # and pin the fastest for this GPU model
  python -m bench.tune_mm --block-k 512,1024 --write  # the whole-K steps against the pinned plans
  python -m bench.tune_mm --ksplit 4,8,16 --write    # K split inside a program against the pinned plans
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable

import torch

from bench.spec_vs_baseline import git_commit
from bench.tune_gemv import L2_BYTES, gpu_and_pdl, time_launch, tuner_args
from bench.tune_gemv import matrices as gemv_matrices
from specsplit.checkpoints.shapes import SHAPES
from specsplit.models.config import LlamaConfig
from specsplit.models.kernels import blocks
from specsplit.models.kernels.blocks import Plan

MM_KERNEL = {"norm_gemv": "norm_mm", "gate_up_silu": "gate_up_silu_mm", "gemv_residual": "mm_residual"}


def matrices(cfg: LlamaConfig) -> list[tuple[str, int, int]]:
    """(kernel, N, K) of every projection of the multi-row step at TP1: the decode's matrices
    (bench.tune_gemv.matrices) under their multi-row kernels."""
    return [(MM_KERNEL[kernel], n, k) for kernel, n, k in gemv_matrices(cfg)]


def launcher(kernel: str, n: int, k: int, rows: int, dtype: torch.dtype, pdl: bool
             ) -> Callable[[Plan], Callable[[], None]]:
    """A function of the plan that returns one projection launch, cycling through weight copies."""
    from specsplit.models.kernels import projections as proj  # Triton: on the GPU machine only

    out_rows = 2 * n if kernel == "gate_up_silu_mm" else n
    copies = max(2, -(-L2_BYTES // (out_rows * k * torch.finfo(dtype).bits // 8)))
    weights = [torch.randn(out_rows, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    tiles = -(-k // 32)
    normed = proj.Normed(x, torch.rand(tiles * proj.padded_rows(rows), device="cuda"), tiles)
    residual, next_norm = torch.randn(rows, n, device="cuda", dtype=dtype), torch.ones(n, device="cuda", dtype=dtype)
    ws = proj.Workspace("cuda")
    turn = [0]

    def make(plan: Plan) -> Callable[[], None]:
        def run() -> None:
            w = weights[turn[0] % copies]
            turn[0] += 1
            ws.plan = lambda *_: plan  # type: ignore[method-assign]
            if kernel == "norm_mm":
                proj.norm_mm(normed, w, 1e-5, pdl, torch.float32 if n > 16384 else None, ws)
            elif kernel == "gate_up_silu_mm":
                proj.gate_up_silu(normed, w, 1e-5, pdl, ws)
            else:
                proj.mm_residual(x, w, residual, pdl, ws, next_norm)

        return run

    return make


def main() -> None:
    p = tuner_args(__doc__, "smollm2-135m", 32, 10)
    p.add_argument("--block-k", default="", help="comma list: time only the candidates of these K steps (with the "
                   "pinned plan and the rule); default: every candidate")
    p.add_argument("--ksplit", default="", help="comma list: time only the candidates that split K inside a program "
                   "this many ways (with the pinned plan and the rule)")
    a = p.parse_args()
    dtype, gpu, pdl = gpu_and_pdl(a)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seen: dict[str, tuple[int, ...]] = {}
    from specsplit.models.kernels import projections as proj  # Triton: on the GPU machine only

    rows = bm = proj.ROW_TILE
    for shape in a.shapes.split(","):
        for kernel, n, k in matrices(SHAPES[shape]):
            name = blocks.mm_key(kernel, n, k, bm)
            if name in seen:
                continue
            make = launcher(kernel, n, k, rows, dtype, pdl)
            pinned, rule = blocks.mm_lookup(kernel, n, k, bm, gpu, sms), blocks.mm_rule(n, k, sms)
            times: dict[Plan, float] = {}
            steps = {int(x) for x in a.block_k.split(",") if x}
            ways = {int(x) for x in a.ksplit.split(",") if x}
            candidates = [q for q in blocks.mm_candidates(k)
                          if (not steps or q.block_k in steps) and (not ways or q.ksplit in ways)]
            for plan in dict.fromkeys([*candidates, pinned, rule]):
                try:
                    times[plan] = time_launch(make(plan), a.launches, a.replays)
                except Exception as e:  # noqa: BLE001 - a tile too large for this GPU's shared memory
                    print(json.dumps({"bench": "tune_mm", "matrix": name, "plan": plan.pinned(),
                                      "skipped": str(e).splitlines()[0][:200]}), flush=True)
            best = min(times, key=times.__getitem__)
            seen[name] = tuple(best.pinned())
            print(json.dumps({
                "bench": "tune_mm", "gpu": gpu, "shape": shape, "matrix": name, "rows": rows, "dtype": a.dtype,
                "pdl": pdl, "best": best.pinned(), "best_splits": best.splits, "best_us": round(times[best], 2),
                "pinned": pinned.pinned(), "pinned_us": round(times.get(pinned, float("nan")), 2),
                "rule": rule.pinned(), "rule_us": round(times.get(rule, float("nan")), 2),
                "all": {" ".join(map(str, q.pinned())): round(t, 2) for q, t in sorted(times.items(),
                                                                                        key=lambda x: x[1])[:8]},
                "commit": git_commit(), "host": platform.node()}), flush=True)
            torch.cuda.empty_cache()
            if a.write:  # after each matrix: a long run interrupted keeps what it measured
                blocks.MM_FILE.write_text(blocks.merged(gpu, {name: seen[name]}, blocks.MM_FILE))
                blocks._read.cache_clear()
    if a.write:
        print(json.dumps({"bench": "tune_mm", "wrote": blocks.MM_FILE.name, "gpu": gpu, "matrices": len(seen)}))


if __name__ == "__main__":
    main()
