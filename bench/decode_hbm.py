"""Target-only decode at batch 1 on one GPU (or --tp-size N ranks) against the HBM bound.

Builds a target of a given shape (default Llama-3.1-8B) with random bf16 weights directly on
the GPU, runs a short prefill, then greedy decoding in each of the --modes (the runner's
execution paths), one JSON line each:
  eager     ragged, kernel by kernel (what CPU serving runs),
  padded    the padded batch, kernel by kernel,
  graphs    the padded batch replayed from CUDA graphs (what CUDA serving runs by default),
  compiled  the same with the padded forward fused by torch.compile first,
  fused     graphs of the fused decode step, five Triton kernels a layer (specsplit.models.fused),
  fused-pdl the same launched with programmatic dependent launch (what `--fused-decode pdl` serves),
with tokens/s, the fraction of the bound weight_bytes / HBM bandwidth and the speed-up over
the first mode, and whether its greedy tokens equal the first mode's (reported: modes that
round differently in bf16 part at near-ties of random weights).

  python -m bench.decode_hbm --modes graphs,fused,fused-pdl --tokens 128
  python -m bench.decode_hbm --modes graphs,fused-pdl --tp-size 8        # weight_gb: one rank's
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.ranks import spawn_ranks
from specsplit.checkpoints.shapes import SHAPES
from specsplit.models.batch import Batch
from specsplit.models.config import LlamaConfig
from specsplit.models.fused import FusedLlama
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from specsplit.runner.runner import ModelRunner, Row, Step


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """argmax of logits [V] as [1, 1], in two short reductions (rows of V/128, then their maxima):
    torch.argmax over a 128k vocabulary is one slow reduction (~26 µs on the H200). Same first
    index as argmax."""
    v = logits.shape[-1]
    rows = 128 if v % 128 == 0 else 1
    best, index = logits.view(rows, -1).max(dim=1)  # [rows]
    r = best.argmax()
    return (index.gather(0, r.view(1)) + r * (v // rows)).view(1, 1)  # no host sync: capturable


def random_model(cfg: LlamaConfig, device: str = "cuda", tp: TensorParallel | None = None
                 ) -> tuple[LlamaModel, torch.Generator]:
    """A bf16 model of this shape with N(0, 0.02) matrices and unit norms, made on the device (one
    rank's shard of it under `tp`: each rank draws its own), and the seeded generator that drew
    them (it draws the prompt next: the same on every rank)."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaModel(cfg, tp or TensorParallel(), cfg.default_aux_layer_ids()).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02, generator=g)
    return model, g.manual_seed(1)


def decode(model: LlamaModel, mode: str, prompt: torch.Tensor, steps: int, max_len: int,
           profile: bool = False) -> tuple[float, list[int]]:
    """Prefill then `steps` greedy decode steps timed after 8 warm-up steps: (seconds, tokens).
    The steps run through the target's ModelRunner: the forward of its padded path (or the fused
    step) and the greedy choice in one graph per context bucket, no host round trip a step."""
    fused = FusedLlama(model, pdl=mode == "fused-pdl") if mode.startswith("fused") else None
    runner = ModelRunner(model, 1, max_len, cuda_graphs=mode not in ("eager", "padded"),
                         compile=mode == "compiled", fused=fused)
    runner.padded = mode != "eager"
    ((logits, _),) = runner.run(Step([Row(0, 0, prompt.tolist())]))
    nxt = logits[-1].argmax().view(1)  # [1]
    slots = torch.zeros(1, dtype=torch.long, device="cuda")
    out: list[torch.Tensor] = []

    def step(pos: int) -> torch.Tensor:
        if mode == "eager":
            ((lg, _),) = runner.run(Step([Row(0, pos, [int(nxt)])]))
            return lg[-1].argmax().view(1)
        ctx = runner.ctx_bucket(pos + 1)
        positions = torch.full((1, 1), pos, dtype=torch.long, device="cuda")

        def fn(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> tuple:
            if fused is not None:
                logits, _ = fused.forward(tokens, Batch.padded(positions, slots, positions, 0), runner.cache)
            else:
                logits, _ = runner.padded_forward(tokens.view(1, 1), positions, slots, positions, ctx)
            return (greedy_token(logits.reshape(-1, logits.shape[-1])[-1]),)  # chosen in the graph too

        (tok,) = runner.graphed(("decode", ctx), fn, tokens=nxt, positions=positions, slots=slots)
        assert tok is not None
        return tok.clone().view(1)

    pos = prompt.shape[0]
    for _ in range(8):  # warm-up (captures the graph of the first context bucket)
        nxt = step(pos)
        out.append(nxt)
        pos += 1
    if mode != "eager":  # capture every later context bucket too, outside the timed steps
        saved = nxt
        for b in runner.ctx_buckets:
            if b > pos:
                step(b - 1)  # a throwaway step at that bucket's last position (the timed steps overwrite it)
        nxt = saved
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = step(pos)
        out.append(nxt)
        pos += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                nxt = step(pos)
                pos += 1
            torch.cuda.synchronize()
        print(f"== {mode}", file=sys.stderr)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), file=sys.stderr)
    return dt, [int(t) for t in torch.cat(out).flatten().tolist()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--hbm-tb-s", type=float, default=4.8, help="H200 HBM3e bandwidth (a GPU's)")
    p.add_argument("--modes", default="eager,padded,graphs",
                   help="comma-separated: eager, padded, graphs, compiled (graphs of the torch.compile'd forward), "
                        "fused, fused-pdl")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES), help="model shape (random weights)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks on cuda:0..N-1 (NCCL); the bound is then one rank's weights "
                        "read at one GPU's bandwidth, all ranks reading at once")
    p.add_argument("--profile", action="store_true", help="also print a torch.profiler table per mode (stderr)")
    a = p.parse_args()
    spawn_ranks(run, a.tp_size, a)


def run(a: argparse.Namespace, tp: TensorParallel) -> None:
    cfg = SHAPES[a.shape]
    model, g = random_model(cfg, tp=tp)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())  # this rank's
    bound = a.hbm_tb_s * 1e12 / weight_bytes
    prompt = torch.randint(0, cfg.vocab_size, (a.prompt,), device="cuda", generator=g)
    base_tps, base_tokens = None, None
    for mode in a.modes.split(","):
        dt, tokens = decode(model, mode, prompt, a.tokens, a.prompt + a.tokens + 16, a.profile)
        tps = a.tokens / dt
        base_tps, base_tokens = base_tps or tps, base_tokens or tokens
        if tp.rank:
            continue
        print(json.dumps({
            "bench": "decode_hbm", "model": cfg.name, "dtype": "bfloat16", "batch": 1, "mode": mode,
            "tp_size": tp.world_size, "weight_gb": round(weight_bytes / 1e9, 3), "tokens": a.tokens,
            "ms_per_token": round(dt / a.tokens * 1e3, 3),
            "tokens_per_s": round(tps, 2), "hbm_bound_tokens_per_s": round(bound, 1),
            "fraction_of_bound": round(tps / bound, 4), "speedup_vs_first_mode": round(tps / base_tps, 3),
            "same_tokens_as_first_mode": tokens == base_tokens, "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
