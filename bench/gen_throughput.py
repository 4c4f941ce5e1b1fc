"""Batched generation throughput of the training command's frozen target (the
self-distillation phase of `specsplit train-head`) at several batch sizes: shows where
it stops being launch-bound. One JSON line per batch size, then (with --profile) the
top CUDA kernels of a 16-token run at the first batch size.

  python -m bench.gen_throughput --model /root/stage/smollm2.gguf --batches 256,512,1024,2048,4096
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.tokenizer import TextCodec
from specsplit.training import prompts as prompt_set
from specsplit.training.distill import generate_batch
from specsplit.training.target import BatchedTarget


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="target: directory, .gguf, or smollm2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="256,512,1024,2048,4096")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    model_dir = resolve_target_dir(a.model)
    target = BatchedTarget.load(str(model_dir), a.device, getattr(torch, a.dtype))
    codec = TextCodec.from_checkpoint(model_dir)
    sizes = [int(b) for b in a.batches.split(",")]
    records = prompt_set.select(prompt_set.load_records(), "train", max(sizes), 0)
    ids = prompt_set.encode(records, codec, target.cfg.vocab_size, 512)

    def sync() -> None:
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)

    generate_batch(target, ids[:8], 8, [])  # warm-up
    for b in sizes:
        sync()
        t0 = time.perf_counter()
        generate_batch(target, ids[:b], a.new_tokens, [])  # no EOS: every sequence runs all steps
        sync()
        dt = time.perf_counter() - t0
        print(json.dumps({"bench": "gen_throughput", "batch": b, "max_prompt": max(map(len, ids[:b])),
                          "new_tokens": a.new_tokens, "seconds": round(dt, 3),
                          "new_tokens_per_s": round(b * a.new_tokens / dt),
                          "ms_per_step": round(dt / (a.new_tokens + 1) * 1e3, 2), "device": a.device,
                          "torch": torch.__version__}), flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate_batch(target, ids[:sizes[0]], 16, [])
            sync()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))


if __name__ == "__main__":
    main()
