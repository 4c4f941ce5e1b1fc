"""Measure the block shapes of the one-token GEMV kernels (kernels.decode) on this GPU, and pin
them (kernels/gemv_blocks.json, read by kernels.blocks): every matrix of the decode step of
each --shapes model, every candidate shape of kernels.blocks.CANDIDATES, µs per launch. A launch
reads its weights from HBM as in a decode (the graph cycles through copies of the matrix that
together exceed the L2 cache). One JSON line per matrix: the fastest blocks, and what the pinned
table and the fixed rule give.

  python -m bench.tune_gemv                    # SmolLM2-135M's and Llama-3.1-8B's matrices
  python -m bench.tune_gemv --write            # and pin the fastest for this GPU model
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable

import torch

from bench.spec_vs_baseline import git_commit
from specsplit.checkpoints.shapes import SHAPES
from specsplit.models.config import LlamaConfig
from specsplit.models.kernels import blocks

L2_BYTES = 64 << 20  # above the L2 of the GPUs we run on (H100 and H200: 50 MiB)


def matrices(cfg: LlamaConfig) -> list[tuple[str, int, int]]:
    """(kernel, N, K) of every GEMV of the one-token decode step at TP1 (kernels.decode's N: the
    output rows; gate_up_silu's weight holds 2N rows)."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    return [("norm_gemv", qkv, h), ("gemv_residual", h, cfg.num_heads * d), ("gate_up_silu", cfg.intermediate_size, h),
            ("gemv_residual", h, cfg.intermediate_size), ("norm_gemv", cfg.vocab_size, h)]


def launcher(kernel: str, n: int, k: int, dtype: torch.dtype, pdl: bool
             ) -> Callable[[blocks.Blocks], Callable[[], None]]:
    """A function of the blocks that returns one GEMV launch, cycling through weight copies."""
    from specsplit.models.kernels import decode  # Triton: on the GPU machine only

    rows = 2 * n if kernel == "gate_up_silu" else n
    copies = max(2, -(-L2_BYTES // (rows * k * torch.finfo(dtype).bits // 8)))
    weights = [torch.randn(rows, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x, nw = torch.randn(k, device="cuda", dtype=dtype), torch.ones(k, device="cuda", dtype=dtype)
    y = torch.empty(n, device="cuda", dtype=torch.float32 if kernel == "norm_gemv" else dtype)
    residual = torch.randn(n, device="cuda", dtype=dtype)
    turn = [0]

    def make(b: blocks.Blocks) -> Callable[[], None]:
        fn = decode._KERNELS[kernel]
        grid = (-(-n // b[0]),)
        launch = {"BLOCK_N": b[0], "BLOCK_K": b[1], "num_warps": b[2], "num_stages": 3, "USE_PDL": pdl,
                  **decode._launch(pdl)}

        def run() -> None:
            w = weights[turn[0] % copies]
            turn[0] += 1
            if kernel == "norm_gemv":
                fn[grid](x, nw, w, y, n, k, k, w.stride(0), 1e-5, HAS_NORM=True, **launch)
            elif kernel == "gate_up_silu":
                fn[grid](x, nw, w, y, n, k, k, w.stride(0), 1e-5, **launch)
            else:
                fn[grid](x, w, residual, y, n, k, w.stride(0), **launch)

        return run

    return make


def time_launch(run: Callable[[], None], launches: int, replays: int) -> float:
    """µs per launch: `launches` launches captured in one graph, replayed `replays` times."""
    for _ in range(3):
        run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (launches * replays)


def tuner_args(doc: str | None, shapes: str, launches: int, replays: int) -> argparse.ArgumentParser:
    """The flags bench.tune_gemv and bench.tune_mm share."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=shapes, help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-pdl", action="store_true", help="time without programmatic dependent launch")
    p.add_argument("--launches", type=int, default=launches, help="launches a graph")
    p.add_argument("--replays", type=int, default=replays)
    p.add_argument("--write", action="store_true", help="pin the fastest for this GPU model")
    return p


def gpu_and_pdl(a: argparse.Namespace) -> tuple[torch.dtype, str, bool]:
    """(dtype, GPU model name, whether launches use PDL) of a tuner's run."""
    pdl = not a.no_pdl and torch.cuda.get_device_capability()[0] >= 9
    return getattr(torch, a.dtype), torch.cuda.get_device_name(), pdl


def main() -> None:
    a = tuner_args(__doc__, "smollm2-135m,llama-3.1-8b", 64, 20).parse_args()
    dtype, gpu, pdl = gpu_and_pdl(a)
    seen: dict[str, blocks.Blocks] = {}
    for shape in a.shapes.split(","):
        for kernel, n, k in matrices(SHAPES[shape]):
            name = blocks.key(kernel, n, k)
            if name in seen:
                continue
            make = launcher(kernel, n, k, dtype, pdl)
            pinned, rule = blocks.lookup(kernel, n, k, gpu), blocks.rule(n, k)
            times = {b: time_launch(make(b), a.launches, a.replays)
                     for b in dict.fromkeys([*blocks.CANDIDATES, pinned, rule])}
            best = min(blocks.CANDIDATES, key=times.__getitem__)
            seen[name] = best
            print(json.dumps({
                "bench": "tune_gemv", "gpu": gpu, "shape": shape, "matrix": name, "dtype": a.dtype, "pdl": pdl,
                "best": list(best), "best_us": round(times[best], 2),
                "pinned": list(pinned), "pinned_us": round(times[pinned], 2),
                "rule": list(rule), "rule_us": round(times[rule], 2),
                "commit": git_commit(), "host": platform.node()}), flush=True)
            torch.cuda.empty_cache()
    if a.write:
        blocks.TABLE_FILE.write_text(blocks.merged(gpu, seen))
        print(json.dumps({"bench": "tune_gemv", "wrote": str(blocks.TABLE_FILE.name), "gpu": gpu,
                          "matrices": len(seen)}))


if __name__ == "__main__":
    main()
