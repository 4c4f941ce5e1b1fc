"""Target-only decode at batch 1 on one GPU against the HBM bound (issue 3a baseline).

Builds a Llama-3.1-8B-shaped target with random bf16 weights directly on the GPU, runs a
short prefill, then greedy decoding, and prints JSON: tokens/s and the fraction of the
bound weight_bytes / HBM bandwidth. Eager PyTorch for now (no CUDA graphs yet).

  python -m bench.decode_hbm --tokens 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specsplit.models.config import LlamaConfig
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel

LLAMA_31_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                          vocab_size=128256, rope_theta=500000.0, max_position=8192, name="llama-3.1-8b-shape",
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--hbm-tb-s", type=float, default=4.8, help="H200 HBM3e bandwidth")
    p.add_argument("--profile", action="store_true", help="also print a torch.profiler table of 4 steps (stderr)")
    a = p.parse_args()
    cfg = LLAMA_31_8B
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaModel(cfg, TensorParallel(), cfg.default_aux_layer_ids()).eval()
    torch.set_default_dtype(torch.float32)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02, generator=g)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    cache = model.new_cache(1, a.prompt + a.tokens + 16)
    tokens = torch.randint(0, cfg.vocab_size, (a.prompt,), device="cuda", generator=g)
    logits, _ = model(tokens, 0, cache, 0)
    nxt = logits[-1].argmax().view(1)
    for i in range(8):  # warm-up
        logits, _ = model(nxt, a.prompt + i, cache, 0)
        nxt = logits[-1].argmax().view(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pos = a.prompt + 8
    for i in range(a.tokens - 8):
        logits, _ = model(nxt, pos + i, cache, 0)
        nxt = logits[-1].argmax().view(1)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = a.tokens - 8
    bound = a.hbm_tb_s * 1e12 / weight_bytes
    if a.profile:
        import sys

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(4):
                logits, _ = model(nxt, pos + n + i, cache, 0)
                nxt = logits[-1].argmax().view(1)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), file=sys.stderr)
    print(json.dumps({
        "bench": "decode_hbm", "model": cfg.name, "dtype": "bfloat16", "batch": 1, "mode": "eager",
        "weight_gb": round(weight_bytes / 1e9, 3), "tokens": n, "ms_per_token": round(dt / n * 1e3, 3),
        "tokens_per_s": round(n / dt, 2), "hbm_bound_tokens_per_s": round(bound, 1),
        "fraction_of_bound": round(n / dt / bound, 4), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
