"""One target step of T tokens for each of B sequences, replayed from a CUDA graph: what a verify
(or B sequences' decodes) costs on the GPU, without the engine's host work around it
(bench.cycle_anatomy measures that).

For each B of --batch, each T of --rows (T = 1 is a decode; T > 1 a verify of a tree, each node
branching --branch ways, as the draft proposes them) and each of the --modes:
  graphs     the runner's padded path with the tree's mask, what the target serves with
             --fused-decode off,
  fused      the fused step (specsplit.models.fused: kernels.decode for one token, kernels.verify
             for more), where B·T fits it,
  fused-pdl  the same with programmatic dependent launch (--fused-decode pdl),
  fused-few, fused-pdl-few  the same with steps of up to 8 rows on kernels.few (the decode's GEMVs
             over every row; without the suffix, as FusedLlama decides),
  fused-tc, fused-pdl-tc  steps of several rows on the tensor-core projections (kernels.projections),
µs per step (mean of --iters replays after 10 warm-up ones, every sequence's committed context
--start tokens long, for each of a comma list), its ratio to the first mode's at the same (B, T),
and its ratio to the same mode's first (B, T) step at that context. Random bf16 weights of
--shape (default SmolLM2-135M's).

  python -m bench.verify_step --rows 1,4,6,16,32 --modes graphs,fused,fused-pdl
  python -m bench.verify_step --batch 1,2,4,8,16,32,64 --rows 1 --modes graphs,fused-pdl   # batched decodes
  python -m bench.verify_step --shape llama-3.1-8b --rows 1,16 --modes graphs,fused --tp-size 2  # each rank a shard
  python -m bench.verify_step --rows 1,16 --modes fused-pdl --start 128,256,512,1024  # by context
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable

import torch

from bench.decode_hbm import random_model
from bench.ranks import spawn_ranks
from bench.spec_vs_baseline import git_commit
from specsplit.checkpoints.shapes import SHAPES
from specsplit.models.batch import Batch, tree_layout
from specsplit.models.fused import FusedLlama
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from specsplit.runner.runner import ModelRunner


def step_fn(model: LlamaModel, mode: str, b: int, t: int, start: int, branch: int, ctx: int
            ) -> tuple[ModelRunner, Callable[..., tuple], dict[str, torch.Tensor]]:
    """A runner, the step as a graph-capturable function of its device inputs, and those inputs."""
    parents = [-1, *((i - 1) // branch for i in range(1, t))]
    positions, rows, cols = tree_layout(start, parents)
    dev = "cuda"
    mask = torch.zeros(b, t, t, dtype=torch.bool, device=dev)
    mask[:, rows, [c - start for c in cols]] = True
    inputs = {"tokens": torch.randint(0, model.cfg.vocab_size, (b * t,), device=dev),
              "positions": torch.tensor([positions] * b, device=dev),
              "slots": torch.arange(b, device=dev),
              "entries": torch.arange(start, start + t, device=dev).repeat(b, 1), "mask": mask}
    few_rows = 0 if mode.endswith("-tc") else 8 if mode.endswith("-few") else None
    fused = FusedLlama(model, pdl=mode.startswith("fused-pdl"), few_rows=few_rows) if mode != "graphs" else None
    runner = ModelRunner(model, b, ctx, fused=fused)

    def step(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor,
             mask: torch.Tensor) -> tuple:
        if fused is not None:
            return fused.forward(tokens, Batch.padded(positions, slots, entries, 0, mask), runner.cache)
        return runner.padded_forward(tokens.view(b, t), positions, slots, entries, ctx, mask)
    return runner, step, inputs


def time_step(model: LlamaModel, mode: str, b: int, t: int, start: int, branch: int, ctx: int, iters: int,
              profile: bool = False) -> float:
    runner, fn, inputs = step_fn(model, mode, b, t, start, branch, ctx)
    for _ in range(10):
        runner.graphed((), fn, **inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        runner.graphed((), fn, **inputs)
    torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / iters * 1e6
    if profile:  # the kernels of 10 steps, by GPU time (under PDL a kernel's time includes its wait)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                runner.graphed((), fn, **inputs)
            torch.cuda.synchronize()
        print(f"== batch {b} rows {t} {mode}", file=sys.stderr)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), file=sys.stderr)
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,4,6,16,32", help="tokens a sequence")
    p.add_argument("--batch", default="1", help="sequences a step")
    p.add_argument("--modes", default="graphs,fused,fused-pdl")
    p.add_argument("--start", default="256", help="committed tokens before the step (a comma list: each in turn)")
    p.add_argument("--branch", type=int, default=4, help="children per tree node")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="also print each step's kernels by GPU time (stderr)")
    p.add_argument("--attention-blocks", default="",
                   help="committed keys per iteration x warps x key ranges of the fused verify's attention to "
                        "try, e.g. 64x4x4,128x8x1 (each a mode of its own; default: kernels.verify.ATTENTION_BLOCK "
                        "only)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks on cuda:0..N-1 (NCCL)")
    a = p.parse_args()
    spawn_ranks(run, a.tp_size, a)


def run(a: argparse.Namespace, tp: TensorParallel) -> None:
    model, _ = random_model(SHAPES[a.shape], tp=tp)
    starts = [int(x) for x in a.start.split(",")]
    modes = a.modes.split(",")
    if a.attention_blocks:
        modes = [m if m == "graphs" else f"{m}@{b}" for m in modes for b in a.attention_blocks.split(",")]
        modes = list(dict.fromkeys(modes))
    from specsplit.models.kernels import verify as verify_kernels  # Triton: on the GPU machine only

    single: dict[tuple[str, int], float] = {}
    for start, b, t in ((s, int(b), int(t)) for s in starts for b in a.batch.split(",") for t in a.rows.split(",")):
        first = 0.0
        for mode in modes:
            if mode != "graphs" and (b * t > verify_kernels.MAX_ROWS or t > verify_kernels.SEQ_ROWS):
                continue  # beyond the fused step: the runner takes the padded path
            if "@" in mode:
                block, warps, splits = mode.split("@")[1].split("x")
                verify_kernels.ATTENTION_BLOCK = (int(block), int(warps), int(splits))
            us = time_step(model, mode.split("@")[0], b, t, start, a.branch, start + 128, a.iters, a.profile)
            first = first or us
            single.setdefault((mode, start), us)
            if tp.rank:
                continue
            print(json.dumps({"bench": "verify_step", "shape": a.shape, "tp_size": tp.world_size, "batch": b,
                              "rows": t, "mode": mode,
                              "us_per_step": round(us, 1), f"x_{modes[0]}": round(first / us, 2),
                              "vs_first_rows": round(us / single[(mode, start)], 2), "start": start,
                              "branch": a.branch,
                              "gpu": torch.cuda.get_device_name(), "commit": git_commit(),
                              "machine": platform.machine()}), flush=True)


if __name__ == "__main__":
    main()
