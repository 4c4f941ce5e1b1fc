"""Where the draft runs, at the Llama-3.1-8B shape with random bf16 weights.

c. One EAGLE-3 proposal step (batch 1, one token) of the head on its own GPU (TP1) against
   the same head sharded TP2 over both GPUs with NCCL, as SGLang runs it inside the target's
   workers. Both with and without CUDA graphs. Prints the step times and the ratio TP2 / TP1.
d. Decode tokens/s of the in-process loop (bench.plain_loop) with the draft on its own GPU
   against the draft on the target's GPU, num_steps 3 and 5, replayed acceptance.

  python -m bench.draft_placement            # needs 2 GPUs
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from bench.plain_loop import generate
from bench.replay import LABEL, Replayer
from specsplit.checkpoints.eagle_head import random_head
from specsplit.checkpoints.shapes import SHAPES, init_random_
from specsplit.cli.launcher import free_port
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.parallel import TensorParallel
from specsplit.runner.runner import ModelRunner


def time_steps(rank: int, world: int, port: int, shape: str, iters: int, q: Any) -> None:  # noqa: ANN401
    """One rank: build the head shard on cuda:rank, time `iters` proposal steps with and without graphs."""
    try:
        torch.cuda.set_device(rank)
        if world > 1:
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    device_id=torch.device("cuda", rank))
        cfg, _ = random_head(SHAPES[shape], draft_vocab_size=32000, seed=0)  # only the config is used
        with torch.device("cuda", rank):
            head = Eagle3Head(cfg, TensorParallel(rank, world)).to(torch.bfloat16).eval()
        init_random_(head, rank, 0.02)
        dev = torch.device("cuda", rank)
        tokens = torch.ones(1, 1, dtype=torch.long, device=dev)
        hidden = torch.randn(1, 1, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        positions = torch.full((1, 1), 100, dtype=torch.long, device=dev)
        slots = torch.zeros(1, dtype=torch.long, device=dev)
        out = {}
        print(f"rank {rank}/{world}: head built", file=sys.stderr, flush=True)
        for graphs in (False, True):
            runner = ModelRunner(head, 1, 1024, cuda_graphs=graphs)

            def fn(tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   runner: ModelRunner = runner) -> tuple:
                return runner.padded_forward(tokens, positions, slots, positions, 128, hidden=hidden)

            for _ in range(10):
                runner.graphed((1,), fn, tokens=tokens, hidden=hidden, positions=positions, slots=slots)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                runner.graphed((1,), fn, tokens=tokens, hidden=hidden, positions=positions, slots=slots)
            torch.cuda.synchronize()
            out["graphs" if graphs else "eager"] = (time.perf_counter() - t0) / iters * 1e6
            print(f"rank {rank}/{world}: graphs={graphs} {out}", file=sys.stderr, flush=True)
        if world > 1:
            dist.destroy_process_group()
        q.put({"rank": rank, **out})
    except BaseException:  # noqa: BLE001
        q.put({"rank": rank, "error": traceback.format_exc()})


def step_times(world: int, shape: str, iters: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=time_steps, args=(r, world, port, shape, iters, q)) for r in range(world)]
    for p in procs:
        p.start()
    outs = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(errors[0])
    return next(o for o in outs if o["rank"] == 0)


def colocation(a: argparse.Namespace) -> list[dict[str, Any]]:
    from draft_service.config import DraftConfig
    from draft_service.runtime import DraftRuntime
    from target_service.config import TargetConfig
    from target_service.runtime import TargetRuntime

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 30000, (64,), generator=g).tolist() for _ in range(a.prompts)]
    target = TargetRuntime(TargetConfig(model=f"shape:{a.shape}", dtype="bfloat16", device="cuda:0",
                                        hidden_backend="cuda_ipc", max_context=1024, max_sequences=2).validate(),
                           TensorParallel())
    assert target.writer is not None
    base = [generate(target, None, p, a.max_new_tokens, 0) for p in prompts]
    refs = [p + r.tokens for p, r in zip(prompts, base, strict=True)]
    rows = []
    for draft_device in ("cuda:1", "cuda:0"):
        draft = DraftRuntime(DraftConfig(head="random", target=f"shape:{a.shape}", dtype="bfloat16",
                                         device=draft_device, max_context=1024, max_sequences=2).validate())
        draft.attach(target.writer.descriptor)
        draft.warm_graphs()  # as the services do once attached
        generate(target, draft, prompts[0], 16, 3)  # warm-up
        for steps in (3, 5):
            replayer = Replayer(refs, a.accept_rate, target.model.cfg.vocab_size)
            runs = [generate(target, draft, p, a.max_new_tokens, steps, replayer) for p in prompts]
            tokens = sum(len(r.tokens) - 1 for r in runs)
            decode_s = sum(r.decode_s for r in runs)
            rows.append({"draft_device": draft_device, "target_device": "cuda:0", "num_steps": steps,
                         "decode_tokens_per_s": round(tokens / decode_s, 2),
                         "draft_us_per_cycle": round(sum(r.draft_ms for r in runs) * 1e3 / sum(r.cycles for r in runs),
                                                     1),
                         "accepted_length": round(tokens / sum(r.cycles for r in runs), 3)})
        del draft
        gc.collect()
        torch.cuda.empty_cache()
    target.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--accept-rate", type=float, default=0.8)
    p.add_argument("--parts", default="tp,colocation")
    a = p.parse_args()
    gpu = torch.cuda.get_device_name()
    if "tp" in a.parts:
        tp1 = step_times(1, a.shape, a.iters)
        print(json.dumps({"bench": "draft_step_tp1", "shape": a.shape, **tp1}), flush=True)
        tp2 = step_times(2, a.shape, a.iters)
        for mode in ("eager", "graphs"):
            print(json.dumps({"bench": "draft_step_tp", "shape": a.shape, "mode": mode, "batch": 1,
                              "tp1_step_us": round(tp1[mode], 1), "tp2_step_us": round(tp2[mode], 1),
                              "ratio_tp2_over_tp1": round(tp2[mode] / tp1[mode], 3), "gpu": gpu}), flush=True)
    if "colocation" in a.parts:
        rows = colocation(a)
        for steps in (3, 5):
            own, shared = (next(r for r in rows if r["num_steps"] == steps and r["draft_device"] == d)
                           for d in ("cuda:1", "cuda:0"))
            print(json.dumps({"bench": "draft_colocation", "label": LABEL, "shape": a.shape, "num_steps": steps,
                              "accept_rate": a.accept_rate, "own_gpu": own, "shared_gpu": shared,
                              "ratio_own_over_shared": round(own["decode_tokens_per_s"] /
                                                             shared["decode_tokens_per_s"], 4), "gpu": gpu}),
                  flush=True)


if __name__ == "__main__":
    main()
